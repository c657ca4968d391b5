// DFlashTreeMask: parent indices -> the gpt attention plugin's spec_decoding_* inputs.
//
// Implements the TensorRT 10.14 IPluginV3 "V3One" interfaces declared in
// include/NvInferPluginBase.h (v_1_0::IPluginV3) and include/NvInferRuntime.h
// (v_1_0::IPluginV3OneCore, v_1_0::IPluginV3OneBuild, v_1_0::IPluginV3OneRuntime,
// v_1_0::IPluginCreatorV3One). See docs/plugins.md for the tensor contract.
#pragma once

#include "plugin_fields.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace dflash::trt
{

class TreeMaskPlugin final : public nvinfer1::IPluginV3,
                             public nvinfer1::IPluginV3OneCore,
                             public nvinfer1::IPluginV3OneBuild,
                             public nvinfer1::IPluginV3OneRuntime
{
public:
    static constexpr char const* kName = "DFlashTreeMask";
    // Inputs and outputs, in order.
    static constexpr int32_t kParents = 0;
    static constexpr int32_t kGenerationLengths = 1;
    static constexpr int32_t kNbInputs = 2;
    static constexpr int32_t kPackedMask = 0;
    static constexpr int32_t kPositionOffsets = 1;
    static constexpr int32_t kLengthsOut = 2;
    static constexpr int32_t kNbOutputs = 3;

    //! Attribute "max_nodes": largest N an engine may feed (1..1024, default 1024).
    static Int32FieldSpec const kFieldSpecs[1];

    TreeMaskPlugin(int32_t maxNodes, std::string pluginNamespace);
    ~TreeMaskPlugin() override = default;
    // mFields points into this object: copies go through clone() instead.
    TreeMaskPlugin(TreeMaskPlugin const&) = delete;
    TreeMaskPlugin& operator=(TreeMaskPlugin const&) = delete;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    int32_t maxNodes() const noexcept
    {
        return mFieldValues[0];
    }

    // Attribute values, in kFieldSpecs order; getFieldsToSerialize points into this.
    int32_t mFieldValues[1];
    std::string mNamespace;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class TreeMaskPluginCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    TreeMaskPluginCreator();
    ~TreeMaskPluginCreator() override = default;

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    //! The namespace this creator is registered under (initDFlashPlugins sets it first).
    void setPluginNamespace(char const* pluginNamespace) noexcept;

private:
    std::string mNamespace{kDefaultPluginNamespace};
    std::vector<nvinfer1::PluginField> mFieldNames;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace dflash::trt
