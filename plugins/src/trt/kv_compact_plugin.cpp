#include "kv_compact_plugin.h"

#include "dflash/cuda_kernels.h"
#include "dflash/kv_compact_core.h"

#include <new>

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
    {"max_seq_len", 0, 0, INT32_MAX},        // linear only; the cache's max_seq dimension
};

bool KVCompactPlugin::validAttributes(int32_t const* values) noexcept
{
    if (values[kFieldLayout] == kPaged && !isPowerOfTwo(values[kFieldTokensPerBlock]))
    {
        logPluginError(kName, "tokens_per_block must be a power of two");
        return false;
    }
    if (values[kFieldLayout] == kLinear && values[kFieldMaxSeqLen] < 1)
    {
        logPluginError(kName, "the linear layout needs max_seq_len >= 1");
        return false;
    }
    if (static_cast<int64_t>(values[kFieldHeadSize]) * values[kFieldElemBytes] > INT32_MAX)
    {
        logPluginError(kName, "head_size * elem_bytes overflows int32");
        return false;
    }
    return true;
}

KVCompactPlugin::KVCompactPlugin(int32_t const* values)
    : mFieldValues{values[0], values[1], values[2], values[3], values[4], values[5], values[6]}
    , mFields(fieldsPointingAt(kFieldSpecs, kNbFields, mFieldValues))
{
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

DataType KVCompactPlugin::inputType(int32_t index) const noexcept
{
    bool const pointerTable = paged() ? index == kHostPoolPointers : index == kHostLayerPointers;
    return pointerTable ? DataType::kINT64 : DataType::kINT32;
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
        return 1; // host layer pointers [num_layers]
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
        return in[kHostLayerPointers].dims.d[0] == layers;
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
    return new (std::nothrow) KVCompactPlugin(mFieldValues);
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
    return kPluginNamespace;
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
                                      : "the linear layout takes 4 inputs and gives 1 output");
        return -1;
    }
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        if (inputTypes[i] != inputType(i))
        {
            logPluginError(kName, "input types: INT32 everywhere except the INT64 host pointer table");
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
    DataType const type = pos < nbInputs ? inputType(pos) : DataType::kINT32;
    return isLinear(inOut[pos].desc, type);
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
    // The layer pointer / pool mapping tables must describe exactly num_layers layers.
    int32_t const table = paged() ? kHostPoolMapping : kHostLayerPointers;
    int64_t const rows = in[table].max.d[0];
    if (rows != -1 && rows != mFieldValues[kFieldNumLayers] && in[table].min.d[0] == in[table].max.d[0])
    {
        logPluginError(kName, "the layer table's first dimension must equal num_layers");
        return -1;
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
        auto* const* layerPointers = static_cast<void* const*>(inputs[kHostLayerPointers]);
        status = launchKVCompactLinear(layerPointers, mFieldValues[kFieldNumLayers], batch,
            mFieldValues[kFieldNumKVHeads], mFieldValues[kFieldMaxSeqLen], headBytes, past, accepted, maxAccepted,
            numAccepted, stream);
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
    return new (std::nothrow) KVCompactPlugin(values);
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
    return kPluginNamespace;
}

} // namespace dflash::trt
