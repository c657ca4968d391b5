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
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

extern "C" bool initDFlashPlugins(void* logger, char const* libNamespace);

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
    {
        TreeMaskPluginCreator other;
        other.setPluginNamespace("elsewhere");
        std::unique_ptr<IPluginV3> p(other.createPlugin("t", nullptr, TensorRTPhase::kBUILD));
        auto* c = static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
        std::unique_ptr<IPluginV3> copy(p->clone());
        auto* cc = static_cast<IPluginV3OneCore*>(copy->getCapabilityInterface(PluginCapabilityType::kCORE));
        check(std::strcmp(other.getPluginNamespace(), "elsewhere") == 0
                && std::strcmp(c->getPluginNamespace(), "elsewhere") == 0
                && std::strcmp(cc->getPluginNamespace(), "elsewhere") == 0,
            "tree: the creator's namespace is the plugin's and its clone's");
    }
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
    {
        // TensorRT may time the layer while building, on its own buffers: nothing runs then.
        setenv("IS_BUILDING", "1", 1);
        void const* noInputs[2] = {nullptr, nullptr};
        void* noOutputs[3] = {nullptr, nullptr, nullptr};
        check(runtime->enqueue(rt.data(), rt.data() + 2, noInputs, noOutputs, nullptr, nullptr) == 0,
            "tree: enqueue returns at once while building");
        unsetenv("IS_BUILDING");
    }
    rt[1].dims.d[0] = 3;
    check(runtime->onShapeChange(rt.data(), 2, rt.data() + 2, 3) != 0, "tree: batch mismatch refused");
    rt[1].dims.d[0] = 2;
    rt[0].dims.d[1] = 65;
    check(runtime->onShapeChange(rt.data(), 2, rt.data() + 2, 3) != 0, "tree: N > max_nodes refused at runtime");
}

Fields kvFields(int32_t layout, int32_t tokensPerBlock)
{
    Fields f;
    f.add("layout", layout);
    f.add("num_layers", 3);
    f.add("num_kv_heads", 2);
    f.add("head_size", 64);
    f.add("elem_bytes", 2);
    f.add("tokens_per_block", tokensPerBlock);
    return f;
}

void testKVCompact()
{
    KVCompactPluginCreator creator;
    PluginFieldCollection const* names = creator.getFieldNames();
    char const* expected[] = {"layout", "num_layers", "num_kv_heads", "head_size", "elem_bytes", "tokens_per_block"};
    bool namesOk = names->nbFields == 6;
    for (int32_t i = 0; namesOk && i < 6; ++i)
    {
        namesOk = std::strcmp(names->fields[i].name, expected[i]) == 0;
    }
    check(namesOk, "kv: field names in order");

    Fields missing;
    missing.add("layout", 1);
    check(creator.createPlugin("k", &missing.collection, TensorRTPhase::kBUILD) == nullptr,
        "kv: missing num_layers refused");
    Fields notPow2 = kvFields(1, 48);
    check(creator.createPlugin("k", &notPow2.collection, TensorRTPhase::kBUILD) == nullptr,
        "kv: tokens_per_block 48 refused");

    // Paged.
    Fields paged = kvFields(1, 32);
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

    {
        // While building, enqueue must not dereference the (builder-owned) pointer tables.
        setenv("IS_BUILDING", "1", 1);
        void const* garbage[6] = {nullptr, nullptr, nullptr, nullptr, reinterpret_cast<void const*>(0x10), nullptr};
        void* outputs[1] = {nullptr};
        auto rtPaged = runtimeDescs(io);
        check(runtime->enqueue(rtPaged.data(), rtPaged.data() + 6, garbage, outputs, nullptr, nullptr) == 0,
            "kv: enqueue returns at once while building");
        unsetenv("IS_BUILDING");
    }

    // Linear: the three layers' caches [batch, 2, 2 heads, 256, 64] are inputs 3..5.
    Fields linear = kvFields(0, 64);
    std::unique_ptr<IPluginV3> lin(creator.createPlugin("k", &linear.collection, TensorRTPhase::kBUILD));
    auto* linBuild = static_cast<IPluginV3OneBuild*>(lin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* linRuntime = static_cast<IPluginV3OneRuntime*>(lin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    DataType linIn[6] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kBF16, DataType::kBF16,
        DataType::kBF16};
    check(linBuild->getOutputDataTypes(out, 1, linIn, 6) == 0, "kv: linear types (bf16 caches)");
    check(linBuild->getOutputDataTypes(out, 1, linIn, 4) != 0, "kv: linear needs 3 + num_layers inputs");
    linIn[4] = DataType::kFLOAT;
    check(linBuild->getOutputDataTypes(out, 1, linIn, 6) != 0, "kv: a 4-byte cache refused when elem_bytes is 2");
    linIn[4] = DataType::kINT64;
    check(linBuild->getOutputDataTypes(out, 1, linIn, 6) != 0, "kv: a pointer table is no longer accepted");
    std::vector<DynamicPluginTensorDesc> linIo = {tensor(DataType::kINT32, {batch, 9}),
        tensor(DataType::kINT32, {batch}), tensor(DataType::kINT32, {batch}),
        tensor(DataType::kHALF, {batch, 2, 2, 256, 64}), tensor(DataType::kHALF, {batch, 2, 2, 256, 64}),
        tensor(DataType::kHALF, {batch, 2, 2, 256, 64}), tensor(DataType::kINT32, {batch})};
    bool linSupported = true;
    for (int32_t pos = 0; pos < 7; ++pos)
    {
        linSupported = linSupported && linBuild->supportsFormatCombination(pos, linIo.data(), 6, 1);
    }
    check(linSupported, "kv: linear formats supported");
    auto linRt = runtimeDescs(linIo);
    check(linRuntime->onShapeChange(linRt.data(), 6, linRt.data() + 6, 1) == 0, "kv: linear shapes accepted");
    linRt[4].dims.d[3] = 128;
    check(linRuntime->onShapeChange(linRt.data(), 6, linRt.data() + 6, 1) != 0, "kv: layers of different length");
    linRt[4].dims.d[3] = 256;
    linRt[5].dims.d[2] = 4;
    check(linRuntime->onShapeChange(linRt.data(), 6, linRt.data() + 6, 1) != 0, "kv: heads != num_kv_heads refused");
    check(linBuild->getWorkspaceSize(linIo.data(), 6, linIo.data() + 6, 1) == 0, "kv: no workspace");
}

// A registry standing in for libnvinfer's (the host test does not link it): records
// what initDFlashPlugins registers and answers getCreator by exact (name, version, namespace).
// It must override the deprecated V2 entry points too (they are pure virtual).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
class RecordingRegistry final : public IPluginRegistry
{
public:
    struct Entry
    {
        IPluginCreatorInterface* creator;
        std::string ns;
    };
    std::vector<Entry> entries;

    bool registerCreator(IPluginCreator&, AsciiChar const* const) noexcept override
    {
        return false;
    }
    IPluginCreator* const* getPluginCreatorList(int32_t* const numCreators) const noexcept override
    {
        *numCreators = 0;
        return nullptr;
    }
    IPluginCreator* getPluginCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept
        override
    {
        return nullptr;
    }
    void setErrorRecorder(IErrorRecorder* const) noexcept override {}
    IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(IPluginCreator const&) noexcept override
    {
        return false;
    }
    bool isParentSearchEnabled() const override
    {
        return false;
    }
    void setParentSearchEnabled(bool const) override {}
    PluginLibraryHandle loadLibrary(AsciiChar const*) noexcept override
    {
        return nullptr;
    }
    void deregisterLibrary(PluginLibraryHandle) noexcept override {}
    bool registerCreator(IPluginCreatorInterface& creator, AsciiChar const* const pluginNamespace) noexcept override
    {
        entries.push_back({&creator, pluginNamespace});
        return true;
    }
    IPluginCreatorInterface* const* getAllCreators(int32_t* const numCreators) const noexcept override
    {
        *numCreators = 0;
        return nullptr;
    }
    IPluginCreatorInterface* getCreator(AsciiChar const* const name, AsciiChar const* const version,
        AsciiChar const* const pluginNamespace) noexcept override
    {
        for (auto const& e : entries)
        {
            auto* v3 = static_cast<IPluginCreatorV3One*>(e.creator);
            if (std::strcmp(v3->getPluginName(), name) == 0 && std::strcmp(v3->getPluginVersion(), version) == 0
                && e.ns == pluginNamespace)
            {
                return e.creator;
            }
        }
        return nullptr;
    }
    bool deregisterCreator(IPluginCreatorInterface const&) noexcept override
    {
        return false;
    }
    IPluginResource* acquirePluginResource(AsciiChar const*, IPluginResource*) noexcept override
    {
        return nullptr;
    }
    int32_t releasePluginResource(AsciiChar const*) noexcept override
    {
        return 0;
    }
    IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const numCreators) noexcept override
    {
        *numCreators = 0;
        return nullptr;
    }
};

#pragma GCC diagnostic pop

RecordingRegistry gRegistry;

void testRegistration()
{
    check(initDFlashPlugins(nullptr, "dflash"), "registration: initDFlashPlugins(\"dflash\") succeeds");
    check(gRegistry.entries.size() == 2, "registration: two creators registered");
    bool same = true;
    for (auto const& e : gRegistry.entries)
    {
        auto* v3 = static_cast<IPluginCreatorV3One*>(e.creator);
        same = same && e.ns == "dflash" && std::strcmp(v3->getPluginNamespace(), "dflash") == 0;
    }
    check(same, "registration: registered under the namespace the creators report");
    auto* tree = static_cast<IPluginCreatorV3One*>(gRegistry.getCreator("DFlashTreeMask", "1", "dflash"));
    auto* kv = static_cast<IPluginCreatorV3One*>(gRegistry.getCreator("DFlashKVCompact", "1", "dflash"));
    check(tree != nullptr && kv != nullptr, "registration: both found by (name, \"1\", \"dflash\")");
    check(gRegistry.getCreator("DFlashTreeMask", "1", "") == nullptr, "registration: nothing under \"\"");
    if (tree != nullptr)
    {
        std::unique_ptr<IPluginV3> plugin(tree->createPlugin("t", nullptr, TensorRTPhase::kBUILD));
        auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
        // An engine stores the plugin's own (name, version, namespace): it must find this creator again.
        check(gRegistry.getCreator(core->getPluginName(), core->getPluginVersion(), core->getPluginNamespace())
                == static_cast<IPluginCreatorInterface*>(tree),
            "registration: a created plugin's (name, version, namespace) finds its creator");
    }
    check(initDFlashPlugins(nullptr, "dflash") && gRegistry.entries.size() == 2,
        "registration: a second call is idempotent");
    check(!initDFlashPlugins(nullptr, "other"), "registration: another namespace afterwards is refused");
}

} // namespace

extern "C" nvinfer1::IPluginRegistry* getPluginRegistry() noexcept
{
    return &gRegistry;
}

int main()
{
    testTreeMask();
    testKVCompact();
    testRegistration();
    std::printf("%s: %d failure(s)\n", gFailures == 0 ? "PASSED" : "FAILED", gFailures);
    return gFailures == 0 ? 0 : 1;
}
