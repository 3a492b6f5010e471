"""``OptimizedModule.generate``: transformers' generation loop, each step through autoopt's
graphs over a static KV cache; the same tokens as ``model.generate`` for the same arguments."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers
from checks import assert_bit_identical, snapshot
from model_zoo import llama_lm
from torch import nn
from torch.utils import _pytree as pytree

import autoopt
from autoopt.errors import ConfigError

transformers.logging.set_verbosity_error()

_VOCAB = 128


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=_VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> nn.Module:
    return llama_lm(_VOCAB)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _prompt(batch: int = 1, length: int = 6) -> torch.Tensor:
    return torch.randint(1, _VOCAB, (batch, length))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_and_scores_are_eager_s(name: str) -> None:
    model = MODELS[name]()
    ids = _prompt()
    before = snapshot(model)
    fast = autoopt.optimize(model, (ids,))
    options = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                   return_dict_in_generate=True)
    got = fast.generate(ids, **options)
    want = model.generate(ids, **options)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = fast.generation_stats  # public: what the last call ran
    assert stats is fast._generator.stats
    assert stats.graph_steps == 5 and stats.eager_steps == 1  # the first prompt allocates
    # The next call: its prompt step runs through a graph too (captured once, for this
    # prompt length), and the call after that captures nothing.
    again = fast.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(again, want.sequences)
    assert fast.generation_stats.eager_steps == 0
    captures = [len(r.captures) for r in fast._generator.reports]
    assert captures == [1, 1]  # decode; prompt (its length symbolic)
    assert torch.equal(fast.generate(ids, max_new_tokens=6, do_sample=False), want.sequences)
    assert [len(r.captures) for r in fast._generator.reports] == captures
    assert all(r.captures[0].method == "export" for r in fast._generator.reports)
    assert_bit_identical(model, before)
    assert "forward" not in vars(model)


def test_padded_batch_sampling_and_eos_match_eager() -> None:
    model = _llama()
    ids = _prompt(batch=3, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generate expects
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    fast = autoopt.optimize(model, (ids,), {"attention_mask": mask})
    for options in (dict(do_sample=False), dict(do_sample=True, top_k=20, temperature=0.8)):
        for _ in range(2):
            torch.manual_seed(11)
            got = fast.generate(ids, attention_mask=mask, max_new_tokens=5, **options)
            torch.manual_seed(11)
            want = model.generate(ids, attention_mask=mask, max_new_tokens=5, **options)
            assert torch.equal(got, want), options
    # Stopping on eos: pick the first token eager produces for row 0 as eos.
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    eos = int(greedy[0, ids.shape[1] + 1])
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                        eos_token_id=eos)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                          eos_token_id=eos)
    assert torch.equal(got, want)


def test_int8_decodes_through_the_graph() -> None:
    model = _gpt2()
    ids = _prompt()
    # (forced: this small model's int8 linears measure slower than fp32's)
    fast = autoopt.optimize(model, (ids,), precision="int8",
                            pass_options={"precision": {"force": True}})
    got = fast.generate(ids, max_new_tokens=4, do_sample=False)
    assert got.shape == (1, ids.shape[1] + 4)
    assert fast._generator.stats.graph_steps == 3
    passes = fast._generator.reports[0].captures[0].passes
    precision = next(p for p in passes if p.name == "precision")
    assert precision.status == "applied", precision


def _int8_llama(seed: int) -> nn.Module:
    """A Llama whose weights (std 0.3) make int8 err near the tolerance: the prompt graph of
    the second call is refused on some seeds, on the cache it writes or on its logits."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


def test_int8_step_graphs_of_a_second_call_verify_or_run_eagerly() -> None:
    """int8 weight-only: the prompt step of the first call runs eagerly (it allocates the
    cache), and its graph is built at the second call. That graph's KV cache was held to
    fp32's by verification, unbudgeted by the precision pass, and its refusal raised out of
    generate. Now the cache is budgeted like the logits; whether a seed's prompt graph then
    verifies depends on which int8 kernel each linear measured fastest (they round alike only
    nearly), so each seed either raises at optimize/first generate (int8 does not apply to its
    decoding), runs its second call through the graphs, or runs the prompt step eagerly."""
    served = 0
    for seed in range(4):
        model = _int8_llama(seed)
        ids = torch.randint(1, 256, (1, 16))
        try:
            fast = autoopt.optimize(model, (ids,), precision="int8", backend="aten",
                                    pass_options={"precision": {"force": True,
                                                                "kernel": "int8_weight"}})
            fast.generate(ids, max_new_tokens=6, do_sample=False)
        except ConfigError as exc:
            assert "precision='int8' cannot apply" in str(exc) or \
                "precision='int8' refused for this model" in str(exc)
            continue
        second = fast.generate(ids, max_new_tokens=6, do_sample=False)
        stats = fast.generation_stats
        assert second.shape == (1, 22) and torch.equal(second[:, :16], ids)
        assert stats.graph_steps + stats.eager_steps == 6 and stats.graph_steps >= 5
        assert bool(stats.eager_steps) == stats.note.startswith(
            "the prompt step ran eagerly: its graph was refused")
        served += 1
    assert served >= 1


def test_a_step_graph_refused_after_a_served_call_runs_eagerly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step graph refused once a call was served (here the prompt graph, built at the
    second call, refused as int8 refuses one on some seeds) is a step run eagerly: said in
    the stats and the report, eager's own token, and not built again at the third call.
    Before any call was served the same refusal raises."""
    from autoopt.generation import generator

    model = _int8_llama(0)
    ids = torch.randint(1, 256, (1, 16))
    fast = autoopt.optimize(model, (ids,))
    real_build = generator.build
    builds = {"prompt": 0}

    def refusing_build(step: nn.Module, args: tuple, kwargs: dict, **options: object) -> object:
        if options.get("dynamic"):  # the prompt step's graph: its length is symbolic
            builds["prompt"] += 1
            raise ConfigError("precision='int8' refused for this model: the outputs differ")
        return real_build(step, args, kwargs, **options)

    monkeypatch.setattr(generator, "build", refusing_build)
    first = fast.generate(ids, max_new_tokens=6, do_sample=False)
    assert fast.generation_stats.eager_steps == 1 and builds["prompt"] == 0
    second = fast.generate(ids, max_new_tokens=6, do_sample=False)
    stats = fast.generation_stats
    assert builds["prompt"] == 1 and torch.equal(second, first)
    assert stats.graph_steps == 5 and stats.eager_steps == 1
    assert stats.note.startswith("the prompt step ran eagerly: its graph was refused "
                                 "(precision='int8' refused for this model")
    assert f"generate: {stats.note}" in fast.report.warnings
    assert torch.equal(second, model.generate(ids, max_new_tokens=6, do_sample=False))
    steps = len(fast._generator.reports)
    third = fast.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(third, second) and builds["prompt"] == 1  # refused for good
    assert len(fast._generator.reports) == steps
    assert fast.generation_stats.eager_steps == 1

    # Before a call was served: the refusal is the first call's error.
    fresh = autoopt.optimize(model, (ids,))

    def refusing_decode(step: nn.Module, args: tuple, kwargs: dict, **options: object) -> object:
        raise ConfigError("precision='int8' refused for this model: the outputs differ")

    monkeypatch.setattr(generator, "build", refusing_decode)
    with pytest.raises(ConfigError, match="refused for this model"):
        fresh.generate(ids, max_new_tokens=6, do_sample=False)


def test_what_generate_cannot_do_is_an_error() -> None:
    linear = autoopt.optimize(nn.Linear(4, 4).eval(), (torch.randn(2, 4),))
    assert not hasattr(linear, "generate")  # only for models that have transformers' own
    model, ids = _gpt2(), _prompt()
    fast = autoopt.optimize(model, (ids,))
    with pytest.raises(ConfigError, match="static KV cache"):
        fast.generate(ids, max_new_tokens=2, cache_implementation="dynamic")
    fast.generate(ids, max_new_tokens=2)  # the next prompt step runs through a graph
    for _ in range(2):  # the first call's eager prompt step, then the graph's
        with pytest.raises(ConfigError, match="a prompt of 60 tokens and max_new_tokens=8 "
                                              "need 68 positions; GPT2LMHeadModel has 64"):
            fast.generate(_prompt(length=60), max_new_tokens=8)
    trained = autoopt.optimize(copy.deepcopy(model).train(), (ids,))
    with pytest.raises(ConfigError, match="train mode"):
        trained.generate(ids, max_new_tokens=2)


def test_a_pickled_module_generates_after_loading() -> None:
    model, ids = _gpt2(), _prompt()
    fast = autoopt.optimize(model, (ids,))
    fast.generate(ids, max_new_tokens=3, do_sample=False)
    loaded = pickle.loads(pickle.dumps(fast))
    got = loaded.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, model.generate(ids, max_new_tokens=3, do_sample=False))


def test_an_encoder_decoder_decodes_through_the_graph() -> None:
    """T5's cache holds a self-attention and a cross-attention static cache; its first
    decoder step fills the cross-attention keys (Python state), the later ones replay."""
    config = transformers.T5Config(vocab_size=_VOCAB, d_model=32, d_kv=16, d_ff=64,
                                   num_layers=2, num_decoder_layers=2, num_heads=2,
                                   decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = _prompt(batch=2, length=9)
    fast = autoopt.optimize(model, (ids,), {"decoder_input_ids": ids[:, :3]})
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    for _ in range(2):
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
        assert fast._generator.stats.graph_steps == 4
    assert [len(r.captures) for r in fast._generator.reports] == [1]


def test_other_lengths_share_one_decode_graph() -> None:
    """The static cache's length is rounded up to a bucket, and the prompt step's graph keeps
    the prompt length symbolic: other prompt lengths and max_new_tokens capture nothing new
    (each graph held a copy of the packed weights: a prompt length cost the weights again)."""
    model = _llama()
    fast = autoopt.optimize(model, (_prompt(),))
    for length, new in ((6, 4), (6, 9), (8, 3)):
        ids = _prompt(length=length)
        got = fast.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        want = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert torch.equal(got, want), (length, new)
    # One decode graph and one prompt graph (its length symbolic) for every call.
    assert [len(r.captures) for r in fast._generator.reports] == [1, 1]


def test_calls_with_other_batch_sizes_get_caches_of_their_own_size() -> None:
    """Each call after the first sizes its cache from the first call's layout (heads, head
    size), with its own batch size, not the first call's (a batch-2 call then a batch-1 call
    allocated a batch-2 cache for one sequence, and the prompt step raised)."""
    model = _llama()
    fast = autoopt.optimize(model, (_prompt(),))
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    for batch in (2, 1, 2):
        ids = _prompt(batch=batch, length=5 + batch)
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options)), batch
    assert fast._generator.stats.eager_steps == 0  # allocated ahead: the prompt step's graph
    # A decode and a prompt graph per batch size (its prompt length symbolic), the second
    # batch-2 call capturing nothing.
    assert sorted(len(r.captures) for r in fast._generator.reports) == [1, 1, 1, 1]


def test_a_cache_of_another_length_is_allocated_ahead_too() -> None:
    """Lengths are rounded up to buckets of 256: a call past the first bucket has a longer
    cache, and the call after it a shorter one again; each is allocated ahead from the first
    call's layout, so only the first call's prompt step runs eagerly."""
    config = transformers.LlamaConfig(vocab_size=_VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=512,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    fast = autoopt.optimize(model, (_prompt(),), backends=("aten",))
    ids = _prompt()
    for new, eager_steps in ((4, 1), (260, 0), (4, 0)):
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options)), new
        assert fast._generator.stats.eager_steps == eager_steps, new


def test_weights_loaded_or_trained_after_generating_are_the_ones_generated_with() -> None:
    """The step graphs read the module's weights as they were when built: a load_state_dict
    (which gives the module memory of its own, apart from your model's) and later in-place
    writes (an optimizer step) are generated with, as eager with those weights does."""
    model = _llama()
    before = snapshot(model)
    fast = autoopt.optimize(model, (_prompt(),))
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    ids = _prompt(batch=2)
    for _ in range(2):  # the decode and the prompt graphs built
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
    reference = copy.deepcopy(model)
    state = {k: v * 1.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    reference.load_state_dict(state)
    fast.module.load_state_dict(state)
    want = reference.generate(ids, **options)
    assert not torch.equal(want, model.generate(ids, **options))  # the load changes tokens
    assert torch.equal(fast.generate(ids, **options), want)
    assert torch.equal(fast.generate(ids, **options), want)
    with torch.no_grad():  # an optimizer step's in-place write, on the module's own memory
        for a, b in zip(fast.module.parameters(), reference.parameters(), strict=True):
            a.mul_(0.5)
            b.mul_(0.5)
    assert torch.equal(fast.generate(ids, **options), reference.generate(ids, **options))
    assert_bit_identical(model, before)  # yours: neither loaded nor written


def test_the_decode_graph_says_why_not_onnxruntime() -> None:
    """The decode step writes the KV cache (its inputs) in place, which an ONNX graph cannot:
    ONNX Runtime is skipped up front (it was exported, run and rolled back on every decode
    graph, seconds of setup each), with the reason in the report."""
    pytest.importorskip("onnxruntime")
    model = _gpt2()
    ids = _prompt()
    fast = autoopt.optimize(model, (ids,), backends=("aten", "onnxruntime"))
    assert torch.equal(fast.generate(ids, max_new_tokens=3, do_sample=False),
                       model.generate(ids, max_new_tokens=3, do_sample=False))
    (choice,) = fast._generator.reports[0].backends
    assert choice.chosen == "aten"
    assert "writes its inputs in place" in choice.skipped["onnxruntime"]


def test_the_prompt_step_runs_on_the_decode_steps_packed_weights() -> None:
    """The prompt step's graph keeps its length symbolic; its linears are packed all the same
    (oneDNN's packed GEMM takes any row count) and call the very copies the decode step packed:
    a model's graphs hold one packed copy of each weight."""
    from autoopt.passes.packed_linear import PackedLinear, kernels

    if "onednn" not in kernels(torch.device("cpu")):
        pytest.skip("this PyTorch build has no oneDNN linear")
    model = _llama()
    ids = _prompt()
    # merge_linear measures per graph: a prompt step may keep siblings apart that the decode
    # step merges, and a merged weight is a weight of its own.
    fast = autoopt.optimize(model, (ids,), backends=("aten",), disable=("merge_linear",),
                            pass_options={"packed_linear": {"measure": False,
                                                            "kernel": "onednn"}})
    for _ in range(2):  # the first call's prompt step runs eagerly: it sizes the cache
        got = fast.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, min_new_tokens=4,
                                           do_sample=False))
    packed = {}
    for (prompt, *_), step in fast._generator._steps.items():
        (spec,) = step.specializations
        packed[prompt] = [n.target.packed for n in spec.graph.graph.nodes
                          if isinstance(n.target, PackedLinear)]
    assert packed[True] and packed[False]
    decode = {id(p) for p in packed[False]}
    assert all(id(p) in decode for p in packed[True])


def _decoder(kind: str = "llama", **config: object) -> nn.Module:
    """A small decoder whose random weights are large enough that its greedy tokens vary
    (transformers' default initializer makes every step pick the same token)."""
    torch.manual_seed(0)
    options = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    options.update(config)
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}
    config_class, model_class = classes[kind]
    return model_class(config_class(**options)).eval()


def _tokens_of(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 101, (batch, length))


def test_attributes_and_hooks_set_after_generating_are_generated_with() -> None:
    """Each step graph runs a copy of ``fast.module`` taken when it was built: an attribute
    set on ``fast.module`` after a generate (and one put back), or a hook registered, were
    honoured by ``fast(x)`` but ``fast.generate`` replayed the old step graphs (other
    tokens, silently). Those steps are built again from the module as it is."""
    model = _decoder()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    fast = autoopt.optimize(model, (_tokens_of(8),))
    ids = _tokens_of(8)
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    original = reference.generate(ids, **options)
    for _ in range(2):  # the decode and the prompt graphs built
        assert torch.equal(fast.generate(ids, **options), original)
    for scaling in (0.05, reference.model.layers[0].self_attn.scaling):
        for m in (fast.module, reference):
            m.model.layers[0].self_attn.scaling = scaling
        want = reference.generate(ids, **options)
        assert torch.equal(fast.generate(ids, **options), want), scaling
        assert fast._generator.stats.graph_steps == 6, scaling
    for m in (fast.module, reference):
        m.model.layers[0].self_attn.scaling = 0.05
    changed = reference.generate(ids, **options)
    assert not torch.equal(changed, original)  # the attribute changes the tokens
    assert torch.equal(fast.generate(ids, **options), changed)
    handles = [m.lm_head.register_forward_hook(lambda _m, _i, out: -out)
               for m in (fast.module, reference)]
    want = reference.generate(ids, **options)
    assert not torch.equal(want, changed)
    assert torch.equal(fast.generate(ids, **options), want)
    for handle in handles:
        handle.remove()
    assert torch.equal(fast.generate(ids, **options), changed)
    assert_bit_identical(model, before)


def test_length_dependent_rotary_frequencies_run_eagerly() -> None:
    """Dynamic NTK rope recomputes its frequencies in Python once the positions pass
    ``max_position_embeddings``: a captured step replayed the short ones (other tokens past
    position 32). Such a model's calls run eagerly, with a note."""
    model = _decoder(max_position_embeddings=32,
                     rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    fast = autoopt.optimize(model, (_tokens_of(20),))
    options = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    for length in (20, 6, 20):
        ids = _tokens_of(length)
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
        stats = fast._generator.stats
        assert stats.graph_steps == 0 and "rope_type 'dynamic'" in stats.note
    assert any("rope_type 'dynamic'" in w for w in fast.report.warnings)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_window_cache_matches_eager_past_its_window(kind: str) -> None:
    """A static sliding-window cache layer counts its tokens in a Python int, which a graph
    replays as captured: once decoding passed the window the steps crashed (an index out of
    bounds) or gave other tokens. A call that fills the window runs eagerly; one that fits
    it keeps a cache as long as the window, which never slides, and runs through graphs."""
    extra = {"head_dim": 16} if kind == "gemma2" else {"num_key_value_heads": 1}
    model = _decoder(kind, sliding_window=8, **extra)
    fast = autoopt.optimize(model, (_tokens_of(6),))
    for length, new, graphs in ((6, 12, False), (12, 10, False), (3, 4, True), (3, 4, True),
                                (6, 12, False), (4, 3, True)):
        ids = _tokens_of(length)
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options)), \
            (length, new)
        stats = fast._generator.stats
        assert bool(stats.graph_steps) == graphs, (length, new, stats)
        assert graphs or "sliding-window" in stats.note


def test_hidden_states_and_attentions_are_eager_s() -> None:
    """The step graphs return the logits alone: ``output_hidden_states`` or
    ``output_attentions`` raised a bare AttributeError. Such a call runs eagerly."""
    model, ids = _gpt2(), _prompt()
    fast = autoopt.optimize(model, (ids,))
    fast.generate(ids, max_new_tokens=3, do_sample=False)  # graphs built
    for name in ("output_hidden_states", "output_attentions"):
        options = {"max_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True,
                   name: True}
        got, want = fast.generate(ids, **options), model.generate(ids, **options)
        assert torch.equal(got.sequences, want.sequences)
        field = "hidden_states" if name == "output_hidden_states" else "attentions"
        for a, b in zip(pytree.tree_leaves(getattr(got, field)),
                        pytree.tree_leaves(getattr(want, field)), strict=True):
            assert torch.equal(a, b)
        assert fast._generator.stats.graph_steps == 0
        assert name in fast._generator.stats.note


def test_another_dtype_and_autocast_generate_as_eager_does() -> None:
    """The cache's layout (dtype, device) was recorded by the first call and kept: after
    ``fast.to(torch.float64)`` the next call allocated a float32 cache and raised. Under
    ``torch.autocast`` the call raised too. The layout follows the module's dtype; an
    autocast call runs eagerly (eager under the same autocast is the reference)."""
    model, ids = _gpt2(), _prompt()
    fast = autoopt.optimize(model, (ids,))
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
        assert "autocast" in fast._generator.stats.note
    assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
    assert fast._generator.stats.eager_steps == 0
    fast.to(torch.float64)
    reference = copy.deepcopy(model).double()
    for _ in range(2):
        assert torch.equal(fast.generate(ids, **options), reference.generate(ids, **options))
    assert fast._generator.stats.graph_steps == 4


def test_use_cache_false_runs_eagerly_and_says_so() -> None:
    """Without a cache there is nothing to keep static: each step runs eagerly, and the note
    says that (it said the model's cache ``()`` was not a static cache)."""
    model, ids = _gpt2(), _prompt()
    fast = autoopt.optimize(model, (ids,))
    options = dict(max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
    assert "use_cache=False" in fast._generator.stats.note
    assert not any("is not a static cache" in w for w in fast.report.warnings)
