#include "tree_mask_plugin.h"

#include "dflash/common.h"
#include "dflash/cuda_kernels.h"
#include "dflash/enqueue_guard.h"
#include "dflash/tree_mask_core.h"

#include <new>
#include <utility>

namespace dflash::trt
{

using nvinfer1::DataType;

Int32FieldSpec const TreeMaskPlugin::kFieldSpecs[1] = {
    {"max_nodes", kMaxTreeNodes, 1, kMaxTreeNodes},
};

TreeMaskPlugin::TreeMaskPlugin(int32_t maxNodes, std::string pluginNamespace)
    : mFieldValues{maxNodes}
    , mNamespace(std::move(pluginNamespace))
    , mFields(fieldsPointingAt(kFieldSpecs, 1, mFieldValues))
{
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

// ---------------------------------------------------------------------- IPluginV3

nvinfer1::IPluginCapability* TreeMaskPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* TreeMaskPlugin::clone() noexcept
{
    return new (std::nothrow) TreeMaskPlugin(maxNodes(), mNamespace);
}

// --------------------------------------------------------------- IPluginV3OneCore

char const* TreeMaskPlugin::getPluginName() const noexcept
{
    return kName;
}

char const* TreeMaskPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* TreeMaskPlugin::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

// -------------------------------------------------------------- IPluginV3OneBuild

int32_t TreeMaskPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t TreeMaskPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputTypes[kParents] != DataType::kINT32
        || inputTypes[kGenerationLengths] != DataType::kINT32)
    {
        logPluginError(kName, "expects two INT32 inputs (parents, generation_lengths)");
        return -1;
    }
    for (int32_t i = 0; i < kNbOutputs; ++i)
    {
        outputTypes[i] = DataType::kINT32;
    }
    return 0;
}

int32_t TreeMaskPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const*, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
    nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    if (nbInputs != kNbInputs || nbShapeInputs != 0 || nbOutputs != kNbOutputs || inputs[kParents].nbDims != 2
        || inputs[kGenerationLengths].nbDims != 1)
    {
        logPluginError(kName, "expects parents [batch, N] and generation_lengths [batch], no shape inputs");
        return -1;
    }
    // The layout the gpt attention plugin reads (docs/plugins.md): mask rows packed by
    // generation length, ceil(max_nodes / 32) words each; offsets max_nodes wide.
    nvinfer1::IDimensionExpr const* batch = inputs[kParents].d[0];
    nvinfer1::IDimensionExpr const* nodes = inputs[kParents].d[1];
    nvinfer1::IDimensionExpr const* rows = exprBuilder.operation(nvinfer1::DimensionOperation::kPROD, *batch, *nodes);
    if (rows == nullptr)
    {
        return -1;
    }
    outputs[kPackedMask].nbDims = 2;
    outputs[kPackedMask].d[0] = rows;
    outputs[kPackedMask].d[1] = exprBuilder.constant(maskWordsFor(maxNodes()));
    outputs[kPositionOffsets].nbDims = 2;
    outputs[kPositionOffsets].d[0] = batch;
    outputs[kPositionOffsets].d[1] = exprBuilder.constant(maxNodes());
    outputs[kLengthsOut].nbDims = 1;
    outputs[kLengthsOut].d[0] = batch;
    return 0;
}

bool TreeMaskPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
    {
        return false;
    }
    // Every tensor is row-major INT32: the gpt attention plugin reads the outputs as int const*.
    return isLinear(inOut[pos].desc, DataType::kINT32);
}

int32_t TreeMaskPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in[kParents].desc.dims.nbDims != 2)
    {
        return -1;
    }
    // Refuse at build time a profile that allows trees larger than the kernel handles.
    int64_t const maxN = in[kParents].max.d[1];
    if (maxN > maxNodes())
    {
        logPluginError(kName, "the optimization profile allows N beyond max_nodes (<= 1024)");
        return -1;
    }
    return 0;
}

size_t TreeMaskPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const*, int32_t,
    nvinfer1::DynamicPluginTensorDesc const*, int32_t) const noexcept
{
    return 0; // one thread per mask row, everything in registers/local memory
}

// ------------------------------------------------------------ IPluginV3OneRuntime

int32_t TreeMaskPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in[kParents].dims.nbDims != 2
        || in[kGenerationLengths].dims.nbDims != 1 || in[kParents].dims.d[0] != in[kGenerationLengths].dims.d[0])
    {
        logPluginError(kName, "parents must be [batch, N] and generation_lengths [batch]");
        return -1;
    }
    int64_t const nodes = in[kParents].dims.d[1];
    if (nodes < 1 || nodes > maxNodes())
    {
        logPluginError(kName, "N (parents.shape[1]) is out of range 1..max_nodes");
        return -1;
    }
    return 0;
}

int32_t TreeMaskPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const*,
    void const* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept
{
    if (skipEnqueueWhileBuilding())
    {
        return 0;
    }
    auto const batch = static_cast<int32_t>(inputDesc[kParents].dims.d[0]);
    auto const nodes = static_cast<int32_t>(inputDesc[kParents].dims.d[1]);
    cudaError_t const status = launchTreeMask(static_cast<int32_t const*>(inputs[kParents]),
        static_cast<int32_t const*>(inputs[kGenerationLengths]), batch, nodes, maxNodes(),
        static_cast<int32_t*>(outputs[kPackedMask]), static_cast<int32_t*>(outputs[kPositionOffsets]),
        static_cast<int32_t*>(outputs[kLengthsOut]), stream);
    if (status != cudaSuccess)
    {
        logPluginError(kName, cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

nvinfer1::IPluginV3* TreeMaskPlugin::attachToContext(nvinfer1::IPluginResourceContext*) noexcept
{
    // No per-context resources: every execution context gets an independent copy.
    return clone();
}

nvinfer1::PluginFieldCollection const* TreeMaskPlugin::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

// ------------------------------------------------------------------------ creator

TreeMaskPluginCreator::TreeMaskPluginCreator()
    : mFieldNames(fieldNamesOf(TreeMaskPlugin::kFieldSpecs, 1))
{
    mFieldCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
    mFieldCollection.fields = mFieldNames.data();
}

nvinfer1::IPluginV3* TreeMaskPluginCreator::createPlugin(
    char const*, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase) noexcept
{
    // The same fields are used at build time and when deserialising (phase kRUNTIME).
    int32_t values[1];
    if (!parseInt32Fields(fc, TreeMaskPlugin::kFieldSpecs, 1, values, TreeMaskPlugin::kName))
    {
        return nullptr;
    }
    return new (std::nothrow) TreeMaskPlugin(values[0], mNamespace);
}

nvinfer1::PluginFieldCollection const* TreeMaskPluginCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* TreeMaskPluginCreator::getPluginName() const noexcept
{
    return TreeMaskPlugin::kName;
}

char const* TreeMaskPluginCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* TreeMaskPluginCreator::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

void TreeMaskPluginCreator::setPluginNamespace(char const* pluginNamespace) noexcept
{
    mNamespace = pluginNamespace == nullptr ? "" : pluginNamespace;
}

} // namespace dflash::trt
