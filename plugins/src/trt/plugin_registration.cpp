// Registers both plugin creators with TensorRT's global plugin registry when the
// library is loaded (ctypes.CDLL(..., RTLD_GLOBAL) or trtexec --dynamicPlugins).
// REGISTER_TENSORRT_PLUGIN is declared in TensorRT's include/NvInferRuntime.h.

#include "kv_compact_plugin.h"
#include "tree_mask_plugin.h"

#include <NvInferRuntime.h>

// The macro's static registrar calls getPluginRegistry()->registerCreator(creator, "").
// The plugins' own namespace ("dflash") comes from getPluginNamespace().
using DFlashTreeMaskPluginCreator = dflash::trt::TreeMaskPluginCreator;
using DFlashKVCompactPluginCreator = dflash::trt::KVCompactPluginCreator;
REGISTER_TENSORRT_PLUGIN(DFlashTreeMaskPluginCreator);
REGISTER_TENSORRT_PLUGIN(DFlashKVCompactPluginCreator);
