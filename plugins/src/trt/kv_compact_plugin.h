// DFlashKVCompact: move the accepted tree tokens' K/V to the slots right after the
// committed prefix, in place, for every layer, in TensorRT-LLM's linear or paged
// KV cache. Same V3One interfaces as tree_mask_plugin.h; contract in docs/plugins.md.
//
// Linear layout: the layers' KV buffers (the engine's past_key_value_{i} inputs) are
// plugin inputs and are updated in place, as the gpt attention plugin updates the buffer
// bound to both past_key_value_{i} and present_key_value_{i}. Paged layout: the pools are
// reached through TensorRT-LLM's own host pointer tables, as the gpt attention plugin
// reaches them. Either way TensorRT sees no write, so the output, the committed lengths
// past + num_accepted, is what orders the plugin: feed it to whatever must run after the
// compaction (the attention's sequence lengths). enqueue() does nothing while TensorRT
// builds (IS_BUILDING=1, enqueue_guard.h): the builder's buffers hold no valid addresses.
#pragma once

#include "plugin_fields.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace dflash::trt
{

class KVCompactPlugin final : public nvinfer1::IPluginV3,
                              public nvinfer1::IPluginV3OneCore,
                              public nvinfer1::IPluginV3OneBuild,
                              public nvinfer1::IPluginV3OneRuntime
{
public:
    static constexpr char const* kName = "DFlashKVCompact";

    enum Layout : int32_t
    {
        kLinear = 0,
        kPaged = 1
    };

    // Inputs common to both layouts.
    static constexpr int32_t kAcceptedNodes = 0;   //!< int32 [batch, max_accepted]
    static constexpr int32_t kNumAccepted = 1;     //!< int32 [batch]
    static constexpr int32_t kPastLengths = 2;     //!< int32 [batch]
    // Paged layout (the gpt attention plugin's tensors).
    static constexpr int32_t kBlockOffsets = 3;    //!< int32 [num_pools, batch, 2, max_blocks_per_seq]
    static constexpr int32_t kHostPoolPointers = 4; //!< int64 [num_pools, 2], host
    static constexpr int32_t kHostPoolMapping = 5; //!< int32 [num_layers, 2], host
    static constexpr int32_t kNbPagedInputs = 6;
    // Linear layout: inputs 3 .. 3 + num_layers - 1 are the layers' KV buffers
    // [batch, 2, num_kv_heads, max_seq_len, head_size], any type of elem_bytes bytes.
    static constexpr int32_t kFirstLayerCache = 3;
    // Output.
    static constexpr int32_t kCommittedLengths = 0; //!< int32 [batch]
    static constexpr int32_t kNbOutputs = 1;

    //! Attributes, in this order: layout, num_layers, num_kv_heads, head_size,
    //! elem_bytes, tokens_per_block (paged).
    enum Field : int32_t
    {
        kFieldLayout = 0,
        kFieldNumLayers,
        kFieldNumKVHeads,
        kFieldHeadSize,
        kFieldElemBytes,
        kFieldTokensPerBlock,
        kNbFields
    };
    static Int32FieldSpec const kFieldSpecs[kNbFields];

    //! Checks the cross-field rules the per-field ranges cannot express.
    static bool validAttributes(int32_t const* values) noexcept;

    KVCompactPlugin(int32_t const* values, std::string pluginNamespace);
    ~KVCompactPlugin() override = default;
    KVCompactPlugin(KVCompactPlugin const&) = delete;
    KVCompactPlugin& operator=(KVCompactPlugin const&) = delete;

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
    bool paged() const noexcept
    {
        return mFieldValues[kFieldLayout] == kPaged;
    }
    int32_t nbInputs() const noexcept
    {
        return paged() ? kNbPagedInputs : kFirstLayerCache + mFieldValues[kFieldNumLayers];
    }
    bool isLayerCache(int32_t index) const noexcept
    {
        return !paged() && index >= kFirstLayerCache;
    }
    //! Whether input `index` may have `type` (pool pointers INT64, caches any type of
    //! elem_bytes bytes, everything else INT32).
    bool inputTypeOk(int32_t index, nvinfer1::DataType type) const noexcept;
    //! Rank of input `index` in this layout.
    int32_t inputRank(int32_t index) const noexcept;
    bool shapesConsistent(nvinfer1::PluginTensorDesc const* in) const noexcept;

    int32_t mFieldValues[kNbFields];
    std::string mNamespace;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class KVCompactPluginCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    KVCompactPluginCreator();
    ~KVCompactPluginCreator() override = default;

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
