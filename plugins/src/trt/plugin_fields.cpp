#include "plugin_fields.h"

#include <cstdio>
#include <cstring>

namespace dflash::trt
{

bool parseInt32Fields(nvinfer1::PluginFieldCollection const* fc, Int32FieldSpec const* specs, int32_t count,
    int32_t* values, char const* pluginName) noexcept
{
    for (int32_t i = 0; i < count; ++i)
    {
        values[i] = specs[i].defaultValue;
    }
    if (fc != nullptr && fc->nbFields > 0 && fc->fields == nullptr)
    {
        logPluginError(pluginName, "the plugin field collection has fields but a null field array");
        return false;
    }
    int32_t const nbFields = fc == nullptr ? 0 : fc->nbFields;
    for (int32_t f = 0; f < nbFields; ++f)
    {
        nvinfer1::PluginField const& field = fc->fields[f];
        if (field.name == nullptr)
        {
            continue;
        }
        for (int32_t i = 0; i < count; ++i)
        {
            if (std::strcmp(field.name, specs[i].name) != 0)
            {
                continue;
            }
            if (field.type != nvinfer1::PluginFieldType::kINT32 || field.length != 1 || field.data == nullptr)
            {
                char message[256];
                std::snprintf(message, sizeof(message), "field '%s' must be one INT32 value", specs[i].name);
                logPluginError(pluginName, message);
                return false;
            }
            std::memcpy(&values[i], field.data, sizeof(int32_t));
        }
    }
    for (int32_t i = 0; i < count; ++i)
    {
        if (values[i] == kRequired)
        {
            char message[256];
            std::snprintf(message, sizeof(message), "required field '%s' is missing", specs[i].name);
            logPluginError(pluginName, message);
            return false;
        }
        if (values[i] < specs[i].minValue || values[i] > specs[i].maxValue)
        {
            char message[256];
            std::snprintf(message, sizeof(message), "field '%s'=%d is out of range %d..%d", specs[i].name,
                values[i], specs[i].minValue, specs[i].maxValue);
            logPluginError(pluginName, message);
            return false;
        }
    }
    return true;
}

std::vector<nvinfer1::PluginField> fieldNamesOf(Int32FieldSpec const* specs, int32_t count)
{
    std::vector<nvinfer1::PluginField> fields;
    fields.reserve(static_cast<size_t>(count));
    for (int32_t i = 0; i < count; ++i)
    {
        fields.emplace_back(specs[i].name, nullptr, nvinfer1::PluginFieldType::kINT32, 1);
    }
    return fields;
}

std::vector<nvinfer1::PluginField> fieldsPointingAt(Int32FieldSpec const* specs, int32_t count, int32_t const* values)
{
    std::vector<nvinfer1::PluginField> fields;
    fields.reserve(static_cast<size_t>(count));
    for (int32_t i = 0; i < count; ++i)
    {
        fields.emplace_back(specs[i].name, &values[i], nvinfer1::PluginFieldType::kINT32, 1);
    }
    return fields;
}

bool isLinear(nvinfer1::PluginTensorDesc const& desc, nvinfer1::DataType type) noexcept
{
    return desc.type == type && desc.format == nvinfer1::TensorFormat::kLINEAR;
}

void logPluginError(char const* pluginName, char const* message) noexcept
{
    std::fprintf(stderr, "[dflash::%s] %s\n", pluginName, message);
}

} // namespace dflash::trt
