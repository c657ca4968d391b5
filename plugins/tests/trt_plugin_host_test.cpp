// Host-side test of the TensorRT plugin classes, built against TensorRT headers and
// the CUDA runtime library but WITHOUT libnvinfer or a GPU: it exercises everything
// that does not need TensorRT's implementation (creators and field parsing,
// serialisation round trips, clone / attachToContext, capability interfaces,
// output types, format support, configurePlugin / onShapeChange checks).
// getOutputShapes (needs TensorRT's IExprBuilder) and enqueue (needs a GPU) are not
// covered here. Run by tests/test_plugins_nvcc.py when TensorRT headers are given.

#include "kv_compact_plugin.h"
#include "tree_mask_plugin.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

using namespace nvinfer1;
using dflash::trt::KVCompactPlugin;
using dflash::trt::KVCompactPluginCreator;
using dflash::trt::TreeMaskPlugin;
using dflash::trt::TreeMaskPluginCreator;

namespace
{

int gFailures = 0;

void check(bool condition, char const* what)
{
    std::printf("%s %s\n", condition ? "ok  " : "FAIL", what);
    if (!condition)
    {
        ++gFailures;
    }
}

struct Fields
{
    std::vector<std::unique_ptr<int32_t>> storage;
    std::vector<PluginField> fields;
    PluginFieldCollection collection{};

    void add(char const* name, int32_t value, PluginFieldType type = PluginFieldType::kINT32)
    {
        storage.push_back(std::make_unique<int32_t>(value));
        fields.emplace_back(name, storage.back().get(), type, 1);
        collection.nbFields = static_cast<int32_t>(fields.size());
        collection.fields = fields.data();
    }
};

int32_t fieldValue(PluginFieldCollection const* fc, char const* name)
{
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        if (std::strcmp(fc->fields[i].name, name) == 0)
        {
            return *static_cast<int32_t const*>(fc->fields[i].data);
        }
    }
    return -12345;
}

DynamicPluginTensorDesc tensor(DataType type, std::vector<int64_t> dims, std::vector<int64_t> maxDims = {})
{
    DynamicPluginTensorDesc desc{};
    desc.desc.type = type;
    desc.desc.format = TensorFormat::kLINEAR;
    desc.desc.dims.nbDims = static_cast<int32_t>(dims.size());
    desc.min.nbDims = desc.max.nbDims = desc.opt.nbDims = desc.desc.dims.nbDims;
    for (size_t i = 0; i < dims.size(); ++i)
    {
        desc.desc.dims.d[i] = dims[i];
        desc.min.d[i] = desc.opt.d[i] = dims[i];
        desc.max.d[i] = maxDims.empty() ? dims[i] : maxDims[i];
    }
    return desc;
}

std::vector<PluginTensorDesc> runtimeDescs(std::vector<DynamicPluginTensorDesc> const& dyn)
{
    std::vector<PluginTensorDesc> out;
    for (auto const& d : dyn)
    {
        out.push_back(d.desc);
    }
    return out;
}

void testTreeMask()
{
    TreeMaskPluginCreator creator;
    PluginFieldCollection const* names = creator.getFieldNames();
    check(names->nbFields == 1 && std::strcmp(names->fields[0].name, "max_nodes") == 0, "tree: field names");
    check(std::strcmp(creator.getPluginName(), "DFlashTreeMask") == 0
            && std::strcmp(creator.getPluginVersion(), "1") == 0
            && std::strcmp(creator.getPluginNamespace(), "dflash") == 0,
        "tree: creator name/version/namespace");

    std::unique_ptr<IPluginV3> defaults(creator.createPlugin("t", nullptr, TensorRTPhase::kBUILD));
    check(defaults != nullptr, "tree: no fields -> defaults");
    Fields big;
    big.add("max_nodes", 1025);
    check(creator.createPlugin("t", &big.collection, TensorRTPhase::kBUILD) == nullptr, "tree: max_nodes 1025 refused");
    Fields wrongType;
    wrongType.add("max_nodes", 8, PluginFieldType::kINT64);
    check(creator.createPlugin("t", &wrongType.collection, TensorRTPhase::kBUILD) == nullptr,
        "tree: INT64 field refused");

    Fields fields;
    fields.add("max_nodes", 64);
    std::unique_ptr<IPluginV3> plugin(creator.createPlugin("t", &fields.collection, TensorRTPhase::kBUILD));
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    auto* concrete = dynamic_cast<TreeMaskPlugin*>(plugin.get());
    check(concrete != nullptr && core == static_cast<IPluginV3OneCore*>(concrete)
            && build == static_cast<IPluginV3OneBuild*>(concrete)
            && runtime == static_cast<IPluginV3OneRuntime*>(concrete),
        "tree: capability interfaces are this object's bases");
    check(std::strcmp(core->getPluginName(), "DFlashTreeMask") == 0, "tree: plugin name");

    // Serialisation round trip through the runtime-phase creator path.
    PluginFieldCollection const* serialized = runtime->getFieldsToSerialize();
    check(fieldValue(serialized, "max_nodes") == 64, "tree: serialised max_nodes");
    std::unique_ptr<IPluginV3> restored(creator.createPlugin("t", serialized, TensorRTPhase::kRUNTIME));
    auto* restoredRuntime
        = static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    check(fieldValue(restoredRuntime->getFieldsToSerialize(), "max_nodes") == 64, "tree: deserialised max_nodes");
    std::unique_ptr<IPluginV3> cloned(plugin->clone());
    std::unique_ptr<IPluginV3> attached(runtime->attachToContext(nullptr));
    check(cloned && attached && cloned.get() != plugin.get(), "tree: clone / attachToContext give new objects");

    check(build->getNbOutputs() == 3, "tree: three outputs");
    DataType in[2] = {DataType::kINT32, DataType::kINT32};
    DataType out[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    check(build->getOutputDataTypes(out, 3, in, 2) == 0 && out[0] == DataType::kINT32 && out[2] == DataType::kINT32,
        "tree: INT32 outputs");
    DataType badIn[2] = {DataType::kINT64, DataType::kINT32};
    check(build->getOutputDataTypes(out, 3, badIn, 2) != 0, "tree: INT64 parents refused");

    std::vector<DynamicPluginTensorDesc> io = {tensor(DataType::kINT32, {2, 40}, {8, 64}),
        tensor(DataType::kINT32, {2}), tensor(DataType::kINT32, {2, 40, 2}), tensor(DataType::kINT32, {2, 40}),
        tensor(DataType::kINT32, {2})};
    bool allSupported = true;
    for (int32_t pos = 0; pos < 5; ++pos)
    {
        allSupported = allSupported && build->supportsFormatCombination(pos, io.data(), 2, 3);
    }
    check(allSupported, "tree: linear INT32 supported at every position");
    io[2].desc.format = TensorFormat::kCHW32;
    check(!build->supportsFormatCombination(2, io.data(), 2, 3), "tree: non-linear format refused");
    io[2].desc.format = TensorFormat::kLINEAR;
    io[0].desc.type = DataType::kFLOAT;
    check(!build->supportsFormatCombination(0, io.data(), 2, 3), "tree: float parents refused");
    io[0].desc.type = DataType::kINT32;

    check(build->configurePlugin(io.data(), 2, io.data() + 2, 3) == 0, "tree: profile N <= max_nodes accepted");
    io[0].max.d[1] = 65;
    check(build->configurePlugin(io.data(), 2, io.data() + 2, 3) != 0, "tree: profile N > max_nodes refused");
    check(build->getWorkspaceSize(io.data(), 2, io.data() + 2, 3) == 0, "tree: no workspace");

    auto rt = runtimeDescs(io);
    check(runtime->onShapeChange(rt.data(), 2, rt.data() + 2, 3) == 0, "tree: consistent shapes accepted");
    rt[1].dims.d[0] = 3;
    check(runtime->onShapeChange(rt.data(), 2, rt.data() + 2, 3) != 0, "tree: batch mismatch refused");
    rt[1].dims.d[0] = 2;
    rt[0].dims.d[1] = 65;
    check(runtime->onShapeChange(rt.data(), 2, rt.data() + 2, 3) != 0, "tree: N > max_nodes refused at runtime");
}

Fields kvFields(int32_t layout, int32_t tokensPerBlock, int32_t maxSeqLen)
{
    Fields f;
    f.add("layout", layout);
    f.add("num_layers", 3);
    f.add("num_kv_heads", 2);
    f.add("head_size", 64);
    f.add("elem_bytes", 2);
    f.add("tokens_per_block", tokensPerBlock);
    f.add("max_seq_len", maxSeqLen);
    return f;
}

void testKVCompact()
{
    KVCompactPluginCreator creator;
    PluginFieldCollection const* names = creator.getFieldNames();
    char const* expected[] = {
        "layout", "num_layers", "num_kv_heads", "head_size", "elem_bytes", "tokens_per_block", "max_seq_len"};
    bool namesOk = names->nbFields == 7;
    for (int32_t i = 0; namesOk && i < 7; ++i)
    {
        namesOk = std::strcmp(names->fields[i].name, expected[i]) == 0;
    }
    check(namesOk, "kv: field names in order");

    Fields missing;
    missing.add("layout", 1);
    check(creator.createPlugin("k", &missing.collection, TensorRTPhase::kBUILD) == nullptr,
        "kv: missing num_layers refused");
    Fields notPow2 = kvFields(1, 48, 0);
    check(creator.createPlugin("k", &notPow2.collection, TensorRTPhase::kBUILD) == nullptr,
        "kv: tokens_per_block 48 refused");
    Fields linearNoLen = kvFields(0, 64, 0);
    check(creator.createPlugin("k", &linearNoLen.collection, TensorRTPhase::kBUILD) == nullptr,
        "kv: linear without max_seq_len refused");

    // Paged.
    Fields paged = kvFields(1, 32, 0);
    std::unique_ptr<IPluginV3> plugin(creator.createPlugin("k", &paged.collection, TensorRTPhase::kBUILD));
    check(plugin != nullptr, "kv: paged plugin created");
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* serialized = runtime->getFieldsToSerialize();
    check(fieldValue(serialized, "tokens_per_block") == 32 && fieldValue(serialized, "num_layers") == 3,
        "kv: serialised fields");
    std::unique_ptr<IPluginV3> restored(creator.createPlugin("k", serialized, TensorRTPhase::kRUNTIME));
    check(restored != nullptr, "kv: deserialised");

    DataType in[6] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT64,
        DataType::kINT32};
    DataType out[1] = {DataType::kFLOAT};
    check(build->getOutputDataTypes(out, 1, in, 6) == 0 && out[0] == DataType::kINT32, "kv: paged types");
    check(build->getOutputDataTypes(out, 1, in, 4) != 0, "kv: paged needs 6 inputs");
    in[4] = DataType::kINT32;
    check(build->getOutputDataTypes(out, 1, in, 6) != 0, "kv: INT32 pool pointers refused");

    int64_t const batch = 4;
    std::vector<DynamicPluginTensorDesc> io = {tensor(DataType::kINT32, {batch, 9}),
        tensor(DataType::kINT32, {batch}), tensor(DataType::kINT32, {batch}),
        tensor(DataType::kINT32, {1, batch, 2, 16}), tensor(DataType::kINT64, {1, 2}),
        tensor(DataType::kINT32, {3, 2}), tensor(DataType::kINT32, {batch})};
    bool supported = true;
    for (int32_t pos = 0; pos < 7; ++pos)
    {
        supported = supported && build->supportsFormatCombination(pos, io.data(), 6, 1);
    }
    check(supported, "kv: paged formats supported");
    check(build->configurePlugin(io.data(), 6, io.data() + 6, 1) == 0, "kv: paged configure");
    auto rt = runtimeDescs(io);
    check(runtime->onShapeChange(rt.data(), 6, rt.data() + 6, 1) == 0, "kv: paged shapes accepted");
    rt[5].dims.d[0] = 2;
    check(runtime->onShapeChange(rt.data(), 6, rt.data() + 6, 1) != 0, "kv: mapping rows != num_layers refused");
    rt[5].dims.d[0] = 3;
    rt[3].dims.d[1] = batch + 1;
    check(runtime->onShapeChange(rt.data(), 6, rt.data() + 6, 1) != 0, "kv: block-offset batch mismatch refused");
    rt[3].dims.d[1] = batch;
    rt[4].dims.d[0] = 2;
    check(runtime->onShapeChange(rt.data(), 6, rt.data() + 6, 1) != 0, "kv: pool count mismatch refused");

    // Linear.
    Fields linear = kvFields(0, 64, 256);
    std::unique_ptr<IPluginV3> lin(creator.createPlugin("k", &linear.collection, TensorRTPhase::kBUILD));
    auto* linBuild = static_cast<IPluginV3OneBuild*>(lin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* linRuntime = static_cast<IPluginV3OneRuntime*>(lin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    DataType linIn[4] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT64};
    check(linBuild->getOutputDataTypes(out, 1, linIn, 4) == 0, "kv: linear types");
    std::vector<DynamicPluginTensorDesc> linIo = {tensor(DataType::kINT32, {batch, 9}),
        tensor(DataType::kINT32, {batch}), tensor(DataType::kINT32, {batch}), tensor(DataType::kINT64, {3}),
        tensor(DataType::kINT32, {batch})};
    bool linSupported = true;
    for (int32_t pos = 0; pos < 5; ++pos)
    {
        linSupported = linSupported && linBuild->supportsFormatCombination(pos, linIo.data(), 4, 1);
    }
    check(linSupported, "kv: linear formats supported");
    auto linRt = runtimeDescs(linIo);
    check(linRuntime->onShapeChange(linRt.data(), 4, linRt.data() + 4, 1) == 0, "kv: linear shapes accepted");
    linRt[3].dims.d[0] = 4;
    check(linRuntime->onShapeChange(linRt.data(), 4, linRt.data() + 4, 1) != 0, "kv: layer pointers != num_layers");
    check(linBuild->getWorkspaceSize(linIo.data(), 4, linIo.data() + 4, 1) == 0, "kv: no workspace");
}

} // namespace

int main()
{
    testTreeMask();
    testKVCompact();
    std::printf("%s: %d failure(s)\n", gFailures == 0 ? "PASSED" : "FAILED", gFailures);
    return gFailures == 0 ? 0 : 1;
}
