"""bench/gguf_file.py: llama.cpp's rows of bench/generate.py run the same weights as the
transformers model (skipped where llama-cpp-python is not installed: it builds llama.cpp from
source, which the test install does not)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gguf_file  # noqa: E402

_MISSING = gguf_file.available()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


class _Record(transformers.LogitsProcessor):
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.seen.append(scores.clone())
        return scores


@pytest.mark.parametrize("build", [_llama, _gpt2])
@torch.no_grad()
def test_an_f32_file_decodes_the_models_tokens_and_logits(build: object,
                                                          tmp_path: Path) -> None:
    """Llama's permuted Q/K rows, GPT-2's transposed Conv1D weights and tied head: llama.cpp
    on the f32 file gives eager's greedy tokens, each step's logits within float rounding;
    Q8_0's first step (the same prefix whatever it picks later) within int8's rounding."""
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, 128, (1, 9))
    eager = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = model(eager).logits[0, ids.shape[1] - 1:-1]
    for kind, within in (("f32", 1e-3), ("Q8_0", 0.1)):
        runner = gguf_file.Runner(gguf_file.write(model, tmp_path / f"{kind}.gguf", kind),
                                  threads=1, context=64)
        record = _Record()
        tokens = runner.generate(ids, 6, logits_processor=[record])
        steps = len(record.seen) if kind == "f32" else 1
        got = torch.cat(record.seen[:steps])
        error = (got - expected[:steps]).abs().max()
        assert error <= within * float(expected.abs().max()), kind
        if kind == "f32":
            assert torch.equal(tokens, eager)
    with pytest.raises(ValueError, match="batch 1"):
        runner.generate(ids.repeat(2, 1), 1)


def test_the_ab_bench_times_both_runners_at_the_same_bits(monkeypatch, tmp_path) -> None:
    """bench/decode_ab.py: one cell per precision, autoopt's and llama.cpp's tokens/s and
    their ratio, from a model the bench builds."""
    import re

    import decode_ab
    import generate

    def wider() -> torch.nn.Module:  # decode steps long enough to time against calls' jitter
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                          num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128)
        return transformers.LlamaForCausalLM(config).eval()

    monkeypatch.setitem(generate.MODELS, "tiny", wider)
    cells = decode_ab.run("tiny", ["int8", "fp32"], threads=1, new=16, rounds=3,
                          folder=tmp_path)
    assert len(cells) == 2 and cells[1] != "refused (no faster kernel)"  # fp32 always runs
    # int8 on this tiny model may measure slower than fp32 here, and is then refused.
    for cell in [c for c in cells if c != "refused (no faster kernel)"]:
        ours, theirs, ratio = re.fullmatch(r"([\d.]+) / ([\d.]+) \(([\d.]+)×\)", cell).groups()
        assert float(ours) > 0 and float(theirs) > 0
        assert abs(float(ratio) - float(ours) / float(theirs)) < 0.02 * float(ratio) + 0.01


def test_a_decode_time_below_the_calls_jitter_is_not_reported_as_a_speed(monkeypatch,
                                                                         tmp_path) -> None:
    """On a model so small that a longer call can time no slower than a 1-token call (CI: the
    tiny model's llama.cpp step at -0.01 ms), the cell says so instead of a speed."""
    import decode_ab
    import generate

    monkeypatch.setitem(generate.MODELS, "tiny", _llama)
    monkeypatch.setattr(decode_ab, "decode_ms", lambda call, new: -0.01)
    cells = decode_ab.run("tiny", ["fp32"], threads=1, new=2, rounds=1, folder=tmp_path)
    assert cells == ["not timed: a longer call was no slower than a 1-token call"]
