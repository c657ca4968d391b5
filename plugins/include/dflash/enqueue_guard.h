// When the TensorRT plugins' enqueue() must do nothing: while TensorRT builds.
//
// TensorRT may run a plugin's enqueue() while it builds the engine (timing layers),
// on buffers it allocated itself and filled with whatever they held. DFlashKVCompact
// dereferences address tables (TensorRT-LLM's host_kv_cache_pool_pointers), so it must
// not run then. TensorRT-LLM marks the build with IS_BUILDING=1 (tensorrt_llm/_common.py,
// _BuildingFlag, around Builder.build_engine) and its gpt attention plugin returns early
// under the same condition; both DFlash plugins follow it. The CPU library exports this
// very function (dflash_enqueue_skipped_while_building) so the tests' TensorRT stand-in
// applies the guard the plugins compile in.
#pragma once

#include <cstdlib>
#include <cstring>

namespace dflash
{

inline bool skipEnqueueWhileBuilding() noexcept
{
    char const* value = std::getenv("IS_BUILDING");
    return value != nullptr && std::strcmp(value, "1") == 0;
}

} // namespace dflash
