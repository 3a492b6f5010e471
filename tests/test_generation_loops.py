"""``fast.generate`` in the loops users write around it: hooks on the model, the cache it
returns, the errors of a call the model cannot run, and which calls build step graphs (batch
sizes, source lengths, a plain call with gradients between generate calls)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from checks import assert_bit_identical, snapshot
from torch import nn

import autoopt
from autoopt.errors import ConfigError

transformers.logging.set_verbosity_error()

_VOCAB = 101


def _decoder(**config: object) -> nn.Module:
    """A small Llama whose random weights are large enough that its greedy tokens vary."""
    torch.manual_seed(0)
    options = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    options.update(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)).eval()


def _ids(length: int = 6, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, _VOCAB, (batch, length))


_GREEDY = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)


def _assert_same(got: object, want: object, tol: float = 1e-4) -> None:
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_hooks_on_the_model_run_once_a_step() -> None:
    """generate calls a driver sharing the model's hook dicts, whose step then called the
    model: a forward hook adding a bias to the logits, and a pre-hook with kwargs shifting
    input_ids, ran twice in every graph step (scores 3.0 off, other tokens). Every hook
    kind, on the model and on a submodule, runs once a step as in eager."""
    model = _decoder()
    bias = torch.linspace(0.0, 3.0, _VOCAB)

    def add_bias(_m: nn.Module, _args: object, out: object) -> object:
        out.logits = out.logits + bias
        return out

    def shift_ids(_m: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if kwargs.get("input_ids") is not None:
            kwargs["input_ids"] = (kwargs["input_ids"] + 1) % _VOCAB
        return args, kwargs

    model.register_forward_hook(add_bias)
    model.register_forward_pre_hook(shift_ids, with_kwargs=True)
    model.model.norm.register_forward_hook(lambda _m, _i, out: out * 1.5)
    ids = _ids()
    fast = autoopt.optimize(model, (ids,), backends=("aten",))
    want = model.generate(ids, max_new_tokens=5, min_new_tokens=5, **_GREEDY)
    for _ in range(2):  # the first call's prompt step eager, the second's through a graph
        got = fast.generate(ids, max_new_tokens=5, min_new_tokens=5, **_GREEDY)
        _assert_same(got, want)
        assert fast._generator.stats.graph_steps >= 4


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=_VOCAB, d_model=32, d_kv=16, d_ff=64,
                                   num_layers=2, num_decoder_layers=2, num_heads=2,
                                   decoder_start_token_id=0, initializer_factor=3.0)
    return transformers.T5ForConditionalGeneration(config).eval()


def _assert_same_cache(got: object, want: object, tol: float = 1e-4) -> None:
    assert type(got) is type(want)
    pairs = ([(got, want)] if not hasattr(want, "self_attention_cache") else
             [(got.self_attention_cache, want.self_attention_cache),
              (got.cross_attention_cache, want.cross_attention_cache)])
    for a, b in pairs:
        assert type(a) is type(b)
        assert int(a.get_seq_length()) == int(b.get_seq_length())
        for x, y in zip(a.layers, b.layers, strict=True):
            assert type(x) is type(y)
            assert x.keys.shape == y.keys.shape
            torch.testing.assert_close(x.keys, y.keys, atol=tol, rtol=tol)
            torch.testing.assert_close(x.values, y.values, atol=tol, rtol=tol)


def test_the_returned_cache_is_the_one_eager_returns() -> None:
    """return_dict_in_generate=True returned the StaticCache the steps ran on, 256 positions
    long, where eager returns a DynamicCache of the tokens fed (and with
    cache_implementation="static" a static cache of the call's own length)."""
    for model, ids in ((_decoder(), _ids()), (_t5(), _ids(9, batch=2))):
        example = {"decoder_input_ids": ids[:, :3]} if model.config.is_encoder_decoder else {}
        fast = autoopt.optimize(model, (ids,), example, backends=("aten",))
        for options in ({}, {"cache_implementation": "static"}, {}):
            got = fast.generate(ids, max_new_tokens=4, min_new_tokens=4, **_GREEDY, **options)
            want = model.generate(ids, max_new_tokens=4, min_new_tokens=4, **_GREEDY,
                                  **options)
            _assert_same(got, want)
            _assert_same_cache(got.cache, want.cache)
            assert fast._generator.stats.graph_steps >= 3


def test_a_call_past_the_models_positions_is_a_clear_error() -> None:
    """GPT-2's position table has 64 rows: max_length=70, or max_new_tokens set in a
    GenerationConfig, raised a bare IndexError (only the max_new_tokens= keyword got a
    clear error), and a 70-token prompt a ModelError about "the example inputs" once the
    prompt step had a graph. Each says what is wrong: before and after the graphs exist."""
    config = transformers.GPT2Config(vocab_size=_VOCAB, n_embd=32, n_layer=1, n_head=2,
                                     n_positions=64, bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config).eval()
    fast = autoopt.optimize(model, (_ids(),), backends=("aten",))
    calls = [
        ((_ids(60),), dict(max_length=70),
         "max_length=70 needs 70 positions; GPT2LMHeadModel has 64"),
        ((_ids(60),), dict(generation_config=transformers.GenerationConfig(max_new_tokens=8)),
         r"a prompt of 60 tokens and max_new_tokens=8 \(from the generation config\) need "
         r"68 positions; GPT2LMHeadModel has 64"),
        ((_ids(70),), dict(max_new_tokens=2),
         "the prompt is 70 tokens, longer than the 64 positions GPT2LMHeadModel has"),
    ]
    for _ in range(2):  # the first call's prompt step eager, then through its graph
        for args, options, message in calls:
            with pytest.raises(ConfigError, match=message):
                fast.generate(*args, do_sample=False, **options)
        assert fast.generate(_ids(), max_new_tokens=3, do_sample=False).shape == (1, 9)


def test_four_batch_sizes_keep_their_graphs() -> None:
    """Four cache shapes are kept: the limit counted step modules, two per shape (prompt and
    decode), so a third batch size threw out the first one's graphs and batches 1, 2, 3, 1
    built two graphs again. Four alternating batch sizes build no graph after warm-up."""
    model = _decoder(num_hidden_layers=1)
    fast = autoopt.optimize(model, (_ids(),), backends=("aten",))
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    fast.generate(_ids(), **options)  # the first call's prompt step runs eagerly
    built = {}
    for round_ in range(2):
        for batch in (1, 2, 3, 4):
            ids = _ids(5, batch=batch)
            assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
            if round_ == 0:
                built = {id(step) for step in fast._generator._steps.values()}
    assert len(built) == 8  # a prompt and a decode step module per batch size
    assert {id(step) for step in fast._generator._steps.values()} == built


def test_a_call_with_gradients_keeps_the_generate_graphs() -> None:
    """``fast(x)`` with gradients enabled gives ``fast.module`` memory of its own apart from
    your model's: every step graph was dropped (they read the old memory) and the next
    generate built both again. The steps follow the module to its memory, graphs kept, and
    see its later writes (an optimizer step's) as before."""
    model = _decoder(num_hidden_layers=1)
    before = snapshot(model)
    ids = _ids()
    fast = autoopt.optimize(model, (ids,), backends=("aten",))
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    for _ in range(2):  # the decode and the prompt graphs built
        fast.generate(ids, **options)
    steps = {id(step): len(step.report.captures) for step in fast._generator._steps.values()}
    assert len(steps) == 2
    fast(ids)  # gradients enabled: a training graph, the module's own memory
    assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
    assert {id(s): len(s.report.captures) for s in fast._generator._steps.values()} == steps
    reference = copy.deepcopy(model)
    with torch.no_grad():  # an optimizer step's in-place write, on the module's own memory
        for a, b in zip(fast.module.parameters(), reference.parameters(), strict=True):
            a.mul_(0.5)
            b.mul_(0.5)
    want = reference.generate(ids, **options)
    assert not torch.equal(want, model.generate(ids, **options))
    assert torch.equal(fast.generate(ids, **options), want)
    assert_bit_identical(model, before)  # yours: neither written nor re-pointed


def test_other_source_lengths_share_the_encoder_decoders_decode_graph() -> None:
    """The cross-attention cache is sized to the encoder's output: source lengths 10, 11, 12
    and 8 built a decode graph each on T5. The encoder's output and its attention mask are
    padded to a bucket (the padding masked out), so ten source lengths build no graph after
    the first call, and the tokens are eager's."""
    model = _t5()
    ids = _ids(9, batch=2)
    fast = autoopt.optimize(model, (ids,), {"decoder_input_ids": ids[:, :3]},
                            backends=("aten",))
    options = dict(max_new_tokens=4, min_new_tokens=4, **_GREEDY)
    steps = None
    for i, length in enumerate((10, 11, 12, 8, 5, 17, 3, 30, 9, 21)):
        ids = _ids(length, batch=2)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # a padded row
        masked = {"attention_mask": mask} if i % 2 else {}  # and calls with no mask
        got = fast.generate(ids, **masked, **options)
        want = model.generate(ids, **masked, **options)
        # (this T5's activations run to ~30: the graph's last bits differ from eager's)
        _assert_same(got, want, tol=2e-3)
        _assert_same_cache(got.cache, want.cache, tol=2e-3)
        now = {id(s): len(s.report.captures) for s in fast._generator._steps.values()}
        assert steps is None or now == steps, length
        steps = now
    assert len(steps) == 1  # one decode graph; the first decoder step runs eagerly


def test_decode_steps_after_a_calls_first_take_the_bound_route(monkeypatch) -> None:
    """The first decode step of a call finds the step graph; the steps after it reuse it
    (``autoopt.generation.bound``) without looking it up again, and the tokens are eager's,
    greedy and sampled, call after call."""
    from autoopt.generation.generator import Generator

    model = _decoder()
    fast = autoopt.optimize(model, (_ids(),))
    found = []
    lookup = Generator.step_for
    monkeypatch.setattr(Generator, "step_for",
                        lambda self, *a, **k: found.append(1) or lookup(self, *a, **k))
    ids = _ids()
    for call in range(2):
        found.clear()
        _assert_same(fast.generate(ids, max_new_tokens=12, **_GREEDY),
                     model.generate(ids, max_new_tokens=12, **_GREEDY))
        # The first call's prompt step allocates the cache, eagerly; the second's runs the
        # prompt graph. Either way one lookup for the decode steps.
        assert fast.generation_stats.graph_steps == 11 + call
        assert len(found) == 1 + call
    torch.manual_seed(5)
    want = model.generate(ids, max_new_tokens=9, do_sample=True, top_k=20)
    torch.manual_seed(5)
    assert torch.equal(fast.generate(ids, max_new_tokens=9, do_sample=True, top_k=20), want)


class _WritesWeights(transformers.LogitsProcessor):
    """Adds the same noise to every linear weight of the model in place, at one step of the
    call (what the step graphs pack or merge are copies of them): what later steps must
    read."""

    def __init__(self, model: nn.Module, at: int) -> None:
        self.model, self.at, self.step = model, at, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.step += 1
        if self.step == self.at:
            noise = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for m in self.model.modules():
                    if isinstance(m, nn.Linear):
                        m.weight.add_(torch.randn(m.weight.shape, generator=noise))
        return scores


def test_a_weight_written_during_a_call_is_read_by_the_steps_after_it() -> None:
    """The bound route checks the module's state as a call does: an in-place write to a
    weight between two decode steps of one call drops the stale graph and the later steps
    read the new weights, as eager's do."""
    model = _decoder()
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, (_ids(),))
    ids = _ids()
    fast.generate(ids, max_new_tokens=4, do_sample=False)  # step graphs built
    want = reference.generate(ids, max_new_tokens=10, do_sample=False,
                              logits_processor=[_WritesWeights(reference, 4)])
    got = fast.generate(ids, max_new_tokens=10, do_sample=False,
                        logits_processor=[_WritesWeights(fast.module, 4)])
    assert torch.equal(got, want)
    assert fast.generation_stats.eager_steps + fast.generation_stats.graph_steps == 10
