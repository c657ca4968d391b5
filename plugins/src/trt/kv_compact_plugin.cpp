#include "kv_compact_plugin.h"

#include "dflash/cuda_kernels.h"
#include "dflash/enqueue_guard.h"
#include "dflash/kv_compact_core.h"

#include <new>
#include <utility>

namespace dflash::trt
{

using nvinfer1::DataType;

Int32FieldSpec const KVCompactPlugin::kFieldSpecs[kNbFields] = {
    {"layout", kPaged, kLinear, kPaged},
    {"num_layers", kRequired, 1, 1 << 16},
    {"num_kv_heads", kRequired, 1, 1 << 16},
    {"head_size", kRequired, 1, 1 << 16},
    {"elem_bytes", 2, 1, 8},                 // 1 for fp8/int8 caches, 2 for fp16/bf16, 4 for fp32
    {"tokens_per_block", 64, 1, 1 << 16},    // paged only; must be a power of two
};

bool KVCompactPlugin::validAttributes(int32_t const* values) noexcept
{
    if (values[kFieldLayout] == kPaged && !isPowerOfTwo(values[kFieldTokensPerBlock]))
    {
        logPluginError(kName, "tokens_per_block must be a power of two");
        return false;
    }
    if (static_cast<int64_t>(values[kFieldHeadSize]) * values[kFieldElemBytes] > INT32_MAX)
    {
        logPluginError(kName, "head_size * elem_bytes overflows int32");
        return false;
    }
    return true;
}

KVCompactPlugin::KVCompactPlugin(int32_t const* values, std::string pluginNamespace)
    : mFieldValues{values[0], values[1], values[2], values[3], values[4], values[5]}
    , mNamespace(std::move(pluginNamespace))
    , mFields(fieldsPointingAt(kFieldSpecs, kNbFields, mFieldValues))
{
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

namespace
{

int32_t sizeOf(DataType type) noexcept
{
    switch (type)
    {
    case DataType::kFLOAT:
    case DataType::kINT32: return 4;
    case DataType::kHALF:
    case DataType::kBF16: return 2;
    case DataType::kINT8:
    case DataType::kFP8:
    case DataType::kUINT8:
    case DataType::kBOOL: return 1;
    case DataType::kINT64: return 8;
    default: return 0;
    }
}

} // namespace

bool KVCompactPlugin::inputTypeOk(int32_t index, DataType type) const noexcept
{
    if (isLayerCache(index))
    {
        bool const cacheType = type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16
            || type == DataType::kINT8 || type == DataType::kFP8;
        return cacheType && sizeOf(type) == mFieldValues[kFieldElemBytes];
    }
    if (paged() && index == kHostPoolPointers)
    {
        return type == DataType::kINT64;
    }
    return type == DataType::kINT32;
}

int32_t KVCompactPlugin::inputRank(int32_t index) const noexcept
{
    switch (index)
    {
    case kAcceptedNodes: return 2;
    case kNumAccepted:
    case kPastLengths: return 1;
    default: break;
    }
    if (!paged())
    {
        return 5; // a layer's cache [batch, 2, heads, max_seq_len, head_size]
    }
    return index == kBlockOffsets ? 4 : 2;
}

bool KVCompactPlugin::shapesConsistent(nvinfer1::PluginTensorDesc const* in) const noexcept
{
    for (int32_t i = 0; i < nbInputs(); ++i)
    {
        if (in[i].dims.nbDims != inputRank(i))
        {
            return false;
        }
    }
    int64_t const batch = in[kAcceptedNodes].dims.d[0];
    if (in[kNumAccepted].dims.d[0] != batch || in[kPastLengths].dims.d[0] != batch
        || in[kAcceptedNodes].dims.d[1] < 1)
    {
        return false;
    }
    int64_t const layers = mFieldValues[kFieldNumLayers];
    if (!paged())
    {
        int64_t const maxSeqLen = in[kFirstLayerCache].dims.d[3];
        for (int32_t l = 0; l < layers; ++l)
        {
            nvinfer1::Dims const& d = in[kFirstLayerCache + l].dims;
            if (d.d[0] != batch || d.d[1] != 2 || d.d[2] != mFieldValues[kFieldNumKVHeads] || d.d[3] != maxSeqLen
                || d.d[3] < 1 || d.d[4] != mFieldValues[kFieldHeadSize])
            {
                return false;
            }
        }
        return true;
    }
    nvinfer1::Dims const& offsets = in[kBlockOffsets].dims;
    nvinfer1::Dims const& pools = in[kHostPoolPointers].dims;
    nvinfer1::Dims const& mapping = in[kHostPoolMapping].dims;
    return offsets.d[1] == batch && offsets.d[2] == 2 && offsets.d[3] >= 1 && pools.d[0] == offsets.d[0]
        && pools.d[1] == 2 && mapping.d[0] == layers && mapping.d[1] == 2;
}

// ---------------------------------------------------------------------- IPluginV3

nvinfer1::IPluginCapability* KVCompactPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* KVCompactPlugin::clone() noexcept
{
    return new (std::nothrow) KVCompactPlugin(mFieldValues, mNamespace);
}

// --------------------------------------------------------------- IPluginV3OneCore

char const* KVCompactPlugin::getPluginName() const noexcept
{
    return kName;
}

char const* KVCompactPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* KVCompactPlugin::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

// -------------------------------------------------------------- IPluginV3OneBuild

int32_t KVCompactPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t KVCompactPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != this->nbInputs() || nbOutputs != kNbOutputs)
    {
        logPluginError(kName, paged() ? "the paged layout takes 6 inputs and gives 1 output"
                                      : "the linear layout takes 3 + num_layers inputs and gives 1 output");
        return -1;
    }
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        if (!inputTypeOk(i, inputTypes[i]))
        {
            logPluginError(kName, "input types: INT32, the INT64 pool pointer table (paged), KV caches of "
                                  "elem_bytes-sized elements (linear)");
            return -1;
        }
    }
    outputTypes[kCommittedLengths] = DataType::kINT32;
    return 0;
}

int32_t KVCompactPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const*, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
    nvinfer1::IExprBuilder&) noexcept
{
    if (nbInputs != this->nbInputs() || nbShapeInputs != 0 || nbOutputs != kNbOutputs)
    {
        return -1;
    }
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        if (inputs[i].nbDims != inputRank(i))
        {
            logPluginError(kName, "an input has the wrong rank (see docs/plugins.md)");
            return -1;
        }
    }
    outputs[kCommittedLengths].nbDims = 1;
    outputs[kCommittedLengths].d[0] = inputs[kNumAccepted].d[0];
    return 0;
}

bool KVCompactPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != this->nbInputs() || nbOutputs != kNbOutputs || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    if (pos < nbInputs && !inputTypeOk(pos, inOut[pos].desc.type))
    {
        return false;
    }
    return isLinear(inOut[pos].desc, pos < nbInputs ? inOut[pos].desc.type : DataType::kINT32);
}

int32_t KVCompactPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    if (nbInputs != this->nbInputs() || nbOutputs != kNbOutputs)
    {
        return -1;
    }
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        if (in[i].desc.dims.nbDims != inputRank(i))
        {
            return -1;
        }
    }
    // The pool mapping table must describe exactly num_layers layers.
    if (paged())
    {
        int64_t const rows = in[kHostPoolMapping].max.d[0];
        if (rows != -1 && rows != mFieldValues[kFieldNumLayers]
            && in[kHostPoolMapping].min.d[0] == in[kHostPoolMapping].max.d[0])
        {
            logPluginError(kName, "the pool mapping's first dimension must equal num_layers");
            return -1;
        }
    }
    return 0;
}

size_t KVCompactPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const*, int32_t,
    nvinfer1::DynamicPluginTensorDesc const*, int32_t) const noexcept
{
    return 0; // layer base pointers travel as kernel arguments (see kLayersPerLaunch)
}

// ------------------------------------------------------------ IPluginV3OneRuntime

int32_t KVCompactPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    if (nbInputs != this->nbInputs() || nbOutputs != kNbOutputs || !shapesConsistent(in))
    {
        logPluginError(kName, "inconsistent input shapes (batch, num_layers or table widths; see docs/plugins.md)");
        return -1;
    }
    return 0;
}

int32_t KVCompactPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const*,
    void const* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept
{
    if (skipEnqueueWhileBuilding())
    {
        return 0; // TensorRT timing the layer: its buffers hold no valid cache addresses
    }
    auto const batch = static_cast<int32_t>(inputDesc[kAcceptedNodes].dims.d[0]);
    auto const maxAccepted = static_cast<int32_t>(inputDesc[kAcceptedNodes].dims.d[1]);
    auto const* accepted = static_cast<int32_t const*>(inputs[kAcceptedNodes]);
    auto const* numAccepted = static_cast<int32_t const*>(inputs[kNumAccepted]);
    auto const* past = static_cast<int32_t const*>(inputs[kPastLengths]);
    int32_t const headBytes = mFieldValues[kFieldHeadSize] * mFieldValues[kFieldElemBytes];

    cudaError_t status = cudaSuccess;
    if (paged())
    {
        // Host tensors: the pool pointers are int64 addresses, exactly the gpt attention
        // plugin's host_kv_cache_pool_pointers / host_kv_cache_pool_mapping.
        auto* const* poolPointers = static_cast<void* const*>(inputs[kHostPoolPointers]);
        status = launchKVCompactPaged(poolPointers, static_cast<int32_t const*>(inputs[kHostPoolMapping]),
            static_cast<int32_t>(inputDesc[kBlockOffsets].dims.d[0]), mFieldValues[kFieldNumLayers],
            static_cast<int32_t const*>(inputs[kBlockOffsets]), batch,
            static_cast<int32_t>(inputDesc[kBlockOffsets].dims.d[3]), mFieldValues[kFieldTokensPerBlock],
            mFieldValues[kFieldNumKVHeads], headBytes, past, accepted, maxAccepted, numAccepted, stream);
    }
    else
    {
        // The caches are inputs written in place (see the header); their device addresses
        // travel to the kernel by value, kLayersPerLaunch at a time.
        auto* const* layerCaches = const_cast<void* const*>(inputs + kFirstLayerCache);
        status = launchKVCompactLinear(layerCaches, mFieldValues[kFieldNumLayers], batch,
            mFieldValues[kFieldNumKVHeads], static_cast<int32_t>(inputDesc[kFirstLayerCache].dims.d[3]), headBytes,
            past, accepted, maxAccepted, numAccepted, stream);
    }
    if (status == cudaSuccess)
    {
        status = launchCommittedLengths(past, numAccepted, batch, static_cast<int32_t*>(outputs[kCommittedLengths]),
            stream);
    }
    if (status != cudaSuccess)
    {
        logPluginError(kName, cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

nvinfer1::IPluginV3* KVCompactPlugin::attachToContext(nvinfer1::IPluginResourceContext*) noexcept
{
    return clone(); // no per-context resources
}

nvinfer1::PluginFieldCollection const* KVCompactPlugin::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

// ------------------------------------------------------------------------ creator

KVCompactPluginCreator::KVCompactPluginCreator()
    : mFieldNames(fieldNamesOf(KVCompactPlugin::kFieldSpecs, KVCompactPlugin::kNbFields))
{
    mFieldCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
    mFieldCollection.fields = mFieldNames.data();
}

nvinfer1::IPluginV3* KVCompactPluginCreator::createPlugin(
    char const*, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase) noexcept
{
    int32_t values[KVCompactPlugin::kNbFields];
    if (!parseInt32Fields(fc, KVCompactPlugin::kFieldSpecs, KVCompactPlugin::kNbFields, values, KVCompactPlugin::kName)
        || !KVCompactPlugin::validAttributes(values))
    {
        return nullptr;
    }
    return new (std::nothrow) KVCompactPlugin(values, mNamespace);
}

nvinfer1::PluginFieldCollection const* KVCompactPluginCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* KVCompactPluginCreator::getPluginName() const noexcept
{
    return KVCompactPlugin::kName;
}

char const* KVCompactPluginCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* KVCompactPluginCreator::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

void KVCompactPluginCreator::setPluginNamespace(char const* pluginNamespace) noexcept
{
    mNamespace = pluginNamespace == nullptr ? "" : pluginNamespace;
}

} // namespace dflash::trt
