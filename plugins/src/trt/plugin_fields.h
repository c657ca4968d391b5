// Small helpers shared by the two TensorRT plugins: int32 plugin-field parsing,
// the serialisation field list, tensor-descriptor checks and error logging.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::trt
{

//! Version of both plugins and the namespace they are registered under unless
//! initDFlashPlugins() is given another (plugin_registration.cpp): the creators, the
//! plugins they create and the registry entry always carry the same namespace, because
//! TensorRT finds a creator by (name, version, namespace) when it deserializes an engine.
constexpr char const* kDefaultPluginNamespace = "dflash";
constexpr char const* kPluginVersion = "1";

//! One int32 plugin attribute: name, default (used when the field is absent;
//! kRequired means it must be given) and the accepted range.
struct Int32FieldSpec
{
    char const* name;
    int32_t defaultValue;
    int32_t minValue;
    int32_t maxValue;
};

constexpr int32_t kRequired = INT32_MIN;

//! Read every spec'd field from `fc` into values[i]. Unknown fields are ignored.
//! Returns false (and logs why) on a wrong type/length, a value out of range, or a
//! missing required field.
bool parseInt32Fields(nvinfer1::PluginFieldCollection const* fc, Int32FieldSpec const* specs, int32_t count,
    int32_t* values, char const* pluginName) noexcept;

//! The creator-side field list (names and types, no data) for getFieldNames().
std::vector<nvinfer1::PluginField> fieldNamesOf(Int32FieldSpec const* specs, int32_t count);

//! The plugin-side field list for getFieldsToSerialize(): entry i points at values[i].
std::vector<nvinfer1::PluginField> fieldsPointingAt(Int32FieldSpec const* specs, int32_t count, int32_t const* values);

//! True when the tensor is `type` in the linear (row-major) format.
bool isLinear(nvinfer1::PluginTensorDesc const& desc, nvinfer1::DataType type) noexcept;

//! Plugins must not throw or abort: they report through this and return an error.
void logPluginError(char const* pluginName, char const* message) noexcept;

} // namespace dflash::trt
