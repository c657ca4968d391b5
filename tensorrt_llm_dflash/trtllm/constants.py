"""Names shared by the engine-path modules (no imports: every trtllm module may use them)."""

#: The architecture name of a converted DFlash checkpoint, registered in TensorRT-LLM's MODEL_MAP.
ARCHITECTURE = "DFlashForCausalLM"
#: This project's ``--speculative_decoding_mode`` value and the TensorRT-LLM mode it maps onto.
DFLASH_MODE = "dflash"
TRTLLM_MODE = "medusa"
MODE_FLAG = "--speculative_decoding_mode"
#: Carries ``--max_draft_len`` into ``DFlashConfig`` (and to mpirun ranks / spawn workers).
MAX_DRAFT_LEN_ENV = "TRTLLM_DFLASH_MAX_DRAFT_LEN"
#: The largest engine draft length: TensorRT-LLM 1.2 builds tree speculative decoding with at
#: most 256 draft tokens (tensorrt_llm/builder.py, build(): "Max draft len > 256 is not
#: supported for EAGLE"; Medusa defaults to 63), which is where the gpt attention plugin's
#: multi-token (XQA spec-decoding) path is exercised upstream.
MAX_ENGINE_DRAFT_LEN = 256
