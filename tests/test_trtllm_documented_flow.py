"""The README's three engine commands on the real demo pair, through the stand-in.

convert_checkpoint.py -> the trtllm-build entry point (--speculative_decoding_mode dflash) ->
run.py --engine_dir, on the embedded SmolLM2-135M-Instruct target and the shipped demo drafter:
the same 30-layer, 9-head (3 KV heads, head size 64) Llama that scripts/verify_trtllm_gpu.sh
builds on a GPU. The target is exported in bf16 (the engine's dtype), so with the stand-in's
exact numerics the engine must give the float64 PyTorch runtime's tokens and per-step
acceptance on the same weights, for DDTree at the engine's maximum budget and for the chain.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import standin
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that reverses a string."
MAX_DRAFT_LEN = 32
MAX_NEW = 48

pytestmark = pytest.mark.slow


def _examples():
    sys.path.insert(0, str(ROOT / "examples"))
    import convert_checkpoint
    import run

    return convert_checkpoint, run


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory):
    from tensorrt_llm_dflash.assets import demo_drafter_dir
    from tensorrt_llm_dflash.target import load_target

    root = tmp_path_factory.mktemp("demo")
    try:
        model, tokenizer = load_target(None)
    except Exception as err:  # noqa: BLE001 - the setup script installs it; say why it is missing
        pytest.fail(f"embedded target unavailable: {err}")
    model.to(torch.bfloat16).save_pretrained(root / "target", safe_serialization=True)
    tokenizer.save_pretrained(root / "target")
    drafter = demo_drafter_dir()
    assert drafter is not None, "the shipped demo drafter is missing"
    return root, root / "target", drafter


def test_documented_flow_equals_the_pytorch_runtime(demo_pair):
    root, target_dir, drafter_dir = demo_pair
    convert_checkpoint, run = _examples()
    assert convert_checkpoint.main(["--model_dir", str(target_dir), "--dflash_model_dir", str(drafter_dir),
                                    "--output_dir", str(root / "ckpt"), "--dtype", "bfloat16", "--no_progress"]) == 0
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm import build

        assert build.main(["--checkpoint_dir", str(root / "ckpt"), "--output_dir", str(root / "engine"),
                           "--speculative_decoding_mode", "dflash", "--max_draft_len", str(MAX_DRAFT_LEN),
                           "--max_batch_size", "1", "--remove_input_padding", "enable",
                           "--max_input_len", "128", "--max_seq_len", "256"]) == 0
        config = json.loads((root / "engine" / "config.json").read_text())
        assert config["pretrained_config"]["architecture"] == "DFlashForCausalLM"
        assert config["pretrained_config"]["dtype"] == "bfloat16"
        assert config["build_config"]["plugin_config"]["paged_kv_cache"] is True  # TensorRT-LLM's default
        for budget in (MAX_DRAFT_LEN, 0):
            engine_json, torch_json = root / f"engine_{budget}.json", root / f"torch_{budget}.json"
            common = ["--input_text", PROMPT, "--max_output_len", str(MAX_NEW), "--ddtree_budget", str(budget),
                      "--device", "cpu"]
            assert run.main(["--engine_dir", str(root / "engine"), "--tokenizer_dir", str(target_dir),
                             "--speculative_decoding_mode", "dflash", "--use_py_session",
                             "--output_json", str(engine_json), *common]) == 0
            assert run.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                             "--dtype", "float64", "--output_json", str(torch_json), *common]) == 0
            got = json.loads(engine_json.read_text())["outputs"][0]
            expected = json.loads(torch_json.read_text())["outputs"][0]
            assert len(got["output_ids"]) == MAX_NEW
            assert got["output_ids"] == expected["output_ids"], budget
            assert got["stats"]["acceptance_lengths"] == expected["stats"]["acceptance_lengths"], budget
            assert got["stats"]["mean_acceptance_length"] > 1.5, budget  # the demo drafter is doing its job
