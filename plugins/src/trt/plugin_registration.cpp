// Registers both plugin creators with TensorRT's plugin registry, under one namespace.
//
// Not REGISTER_TENSORRT_PLUGIN: its registrar always registers under the empty
// namespace (include/NvInferRuntime.h, PluginRegistrar: registerCreator(instance, "")),
// while TensorRT looks a creator up by the (name, version, namespace) the plugin
// reports. TensorRT-LLM registers its own library the same way as here
// (cpp/tensorrt_llm/plugins/api/tllmPlugin.cpp, initTrtLlmPlugins: set the creator's
// namespace, then registerCreator(*creator, libNamespace)). Python calls this right after
// loading the library (tensorrt_llm_dflash/trtllm/plugins.py, load_plugin_library).

#include "kv_compact_plugin.h"
#include "tree_mask_plugin.h"

#include <NvInferRuntime.h>

#include <mutex>
#include <string>

#if defined(_WIN32)
#define DFLASH_TRT_API __declspec(dllexport)
#else
#define DFLASH_TRT_API __attribute__((visibility("default")))
#endif

extern "C" {

//! Register DFlashTreeMask and DFlashKVCompact (version "1") under `libNamespace`
//! ("dflash" when null). Idempotent: a second call with the same namespace returns true,
//! one with another namespace false (the creators cannot live under two namespaces).
//! The logger argument mirrors initTrtLlmPlugins and is unused.
DFLASH_TRT_API bool initDFlashPlugins(void* /*logger*/, char const* libNamespace)
{
    static std::mutex mutex;
    static dflash::trt::TreeMaskPluginCreator treeMask;
    static dflash::trt::KVCompactPluginCreator kvCompact;
    static bool registered = false;
    static std::string registeredNamespace;

    std::string const ns = libNamespace == nullptr ? dflash::trt::kDefaultPluginNamespace : libNamespace;
    std::lock_guard<std::mutex> lock(mutex);
    if (registered)
    {
        return ns == registeredNamespace;
    }
    treeMask.setPluginNamespace(ns.c_str());
    kvCompact.setPluginNamespace(ns.c_str());
    nvinfer1::IPluginRegistry* registry = getPluginRegistry();
    if (registry == nullptr || !registry->registerCreator(treeMask, ns.c_str())
        || !registry->registerCreator(kvCompact, ns.c_str()))
    {
        return false;
    }
    registered = true;
    registeredNamespace = ns;
    return true;
}

} // extern "C"
