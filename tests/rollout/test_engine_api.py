"""RolloutEngine API: streaming steps, stop conditions, abort, weight updates, KV sizing, errors, CLI helper."""

from __future__ import annotations

import pytest
import torch

from rlalign.models.generate import generate as simple_generate
from rlalign.models.testing import make_tiny_checkpoint, tiny_model
from rlalign.models import load_model, load_tokenizer
from rlalign.rollout import (KVCacheTooSmallError, RequestError, RolloutConfig, RolloutConfigError, RolloutEngine,
                             RolloutError, SamplingParams, WeightsUpdateError, generate_completions)
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.rollout.test_engine_bitwise import assert_matches_trainer, assert_same_completions, trainer_logprobs

PROMPTS = [[5, 9, 33, 7, 81], [100, 3], [17] * 11]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=7, init_std=0.1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="qwen3", seed=1, init_std=0.1)


def small_engine(model, **overrides) -> RolloutEngine:
    return RolloutEngine(model, RolloutConfig(**{"num_pages": 64, "page_size": 4, **overrides}))


def test_step_streams_every_token_and_the_completion_matches(model):
    engine = small_engine(model)
    sampling = SamplingParams(n=2, max_new_tokens=6, seed=1, ignore_eos=True)
    rid = engine.add_request(PROMPTS[0], sampling, request_id="r0", prompt_index=0)
    assert rid == "r0" and engine.has_unfinished()
    streamed: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    completions = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "r0"
            streamed[out.sample_index].append((out.token, out.logprob))
            if out.finished:
                completions[out.sample_index] = out.completion
    for j, c in completions.items():
        assert c.tokens == [t for t, _ in streamed[j]] and c.logprobs == [lp for _, lp in streamed[j]]
        assert c.finish_reason == "length" and len(c.tokens) == 6 and c.weights_version == 0
    assert engine.step() == []
    batch = engine.generate([PROMPTS[0]], sampling)
    assert_same_completions(batch, [completions[0], completions[1]])


def test_stop_token_ends_the_sample_and_is_kept(model):
    engine = small_engine(model)
    everything = tuple(range(model.config.vocab_size))
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, stop_token_ids=everything))
    for c in out:
        assert len(c.tokens) == 1 and c.finish_reason == "stop" and c.stop_reason == c.tokens[0]


def test_eos_is_a_stop_token_unless_ignored(model):
    engine = small_engine(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    first = engine.generate([PROMPTS[1]], greedy)[0].tokens[0]
    eos_model = tiny_model("qwen2", seed=7, init_std=0.1, eos_token_id=first)
    eos_engine = small_engine(eos_model)
    assert eos_engine.generate([PROMPTS[1]], greedy)[0].finish_reason == "stop"
    ignored = eos_engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and len(ignored.tokens) == 3


def test_stop_strings_need_a_tokenizer_and_end_at_the_completing_token(checkpoint):
    model, _ = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    engine = RolloutEngine(model, RolloutConfig(num_pages=64), tokenizer=tokenizer)
    stops = ("e", "a", "o", "t")
    out = engine.generate(["What is 2 + 3?", "hello world"], SamplingParams(n=3, max_new_tokens=30, stop=stops, ignore_eos=True))
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped, "no sample met a stop string in 30 tokens"
    for c in stopped:
        assert c.stop_reason in stops and c.stop_reason in c.text
        assert not any(s in tokenizer.decode(c.tokens[:-1]) for s in stops)
    with pytest.raises(RequestError, match="tokenizer"):
        RolloutEngine(model, RolloutConfig(num_pages=64)).add_request([5, 6], SamplingParams(stop=("x",)))


def test_max_model_len_cuts_generation(model):
    engine = small_engine(model, max_model_len=len(PROMPTS[0]) + 3)
    c = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(c.tokens) == 3 and c.finish_reason == "length"
    with pytest.raises(RequestError, match="max_model_len"):
        small_engine(model, max_model_len=5).add_request(PROMPTS[0])


def test_abort_ends_a_request_and_frees_its_pages(model):
    engine = small_engine(model)
    engine.add_request(PROMPTS[2], SamplingParams(n=3, max_new_tokens=50, ignore_eos=True), request_id="a")
    engine.step()
    engine.step()
    outs = engine.abort("a")
    assert len(outs) == 3 and all(o.finished and o.completion.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_pages
    with pytest.raises(RequestError, match="unknown request"):
        engine.abort("a")


def test_abort_before_the_leader_forks_ends_every_sample(model):
    engine = small_engine(model)
    engine.add_request(PROMPTS[0], SamplingParams(n=4, max_new_tokens=5), request_id="x")
    assert len(engine.abort("x")) == 4 and not engine.has_unfinished()


def test_update_weights_in_place_matches_a_fresh_engine_and_the_trainer(model):
    sampling = SamplingParams(n=2, max_new_tokens=6, seed=3, ignore_eos=True)
    engine = small_engine(tiny_model("qwen2", seed=7, init_std=0.1), enable_prefix_caching=True)
    before = engine.generate(PROMPTS, sampling)
    new = tiny_model("qwen2", seed=8, init_std=0.1)
    assert engine.update_weights(new.state_dict()) == 1
    after = engine.generate(PROMPTS, sampling)
    assert all(c.weights_version == 1 for c in after) and all(c.weights_version == 0 for c in before)
    assert_same_completions(after, small_engine(new).generate(PROMPTS, sampling))
    assert_matches_trainer(new, after, 1.0)
    assert [c.tokens for c in after] != [c.tokens for c in before]
    # an iterator of (name, tensor), with an explicit version
    assert engine.update_weights(iter(model.state_dict().items()), version=10) == 10
    assert_same_completions(engine.generate(PROMPTS, sampling), small_engine(model).generate(PROMPTS, sampling))


def test_update_weights_is_refused_with_requests_in_flight(model):
    engine = small_engine(tiny_model("qwen2", seed=7, init_std=0.1))
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    engine.step()
    with pytest.raises(WeightsUpdateError, match="in flight"):
        engine.update_weights(model.state_dict())
    assert engine.weights_version == 0
    engine.abort_all()
    assert engine.update_weights(model.state_dict()) == 1


def test_a_failed_update_blocks_generation_until_a_complete_one(model):
    engine = small_engine(tiny_model("qwen2", seed=7, init_std=0.1))
    with pytest.raises(WeightsUpdateError, match="unknown parameter"):
        engine.update_weights({"model.embed_tokens.weight": model.model.embed_tokens.weight, "nope": torch.zeros(1)})
    with pytest.raises(WeightsUpdateError, match="mix"):
        engine.add_request(PROMPTS[0])
    with pytest.raises(WeightsUpdateError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)})
    engine.update_weights(model.state_dict())
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))


def test_kv_cache_size_from_a_byte_budget_and_too_small_errors(model):
    engine = RolloutEngine(model, RolloutConfig(page_size=4, kv_cache_bytes=100_000))
    assert engine.blocks.num_pages == 100_000 // engine.bytes_per_page
    assert engine.kv_cache.k[0].shape[:2] == (engine.blocks.num_pages, 4)
    with pytest.raises(KVCacheTooSmallError, match="needs 5 pages"):
        small_engine(model, num_pages=4).add_request(PROMPTS[0], SamplingParams(max_new_tokens=16))
    with pytest.raises(KVCacheTooSmallError, match="raise kv_cache_bytes"):
        RolloutEngine(model, RolloutConfig(kv_cache_bytes=10))


def test_invalid_requests_and_configs_raise_clear_errors(model):
    engine = small_engine(model)
    with pytest.raises(RequestError, match="no tokens"):
        engine.add_request([])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, 10_000])
    with pytest.raises(RequestError, match="need a tokenizer"):
        engine.add_request("hello")
    engine.add_request([1, 2], request_id="dup")
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_request([1, 2], request_id="dup")
    with pytest.raises(RolloutError, match="idle engine"):
        engine.generate([[1, 2]])
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RolloutConfigError, match="page_size"):
        RolloutConfig(page_size=0)
    with pytest.raises(ValueError, match="unknown profile"):
        RolloutConfig(profile="fast")


def test_prefix_sharing_prefills_a_prompt_once_and_caching_reuses_it_across_requests(model):
    sampling = SamplingParams(n=4, max_new_tokens=3, seed=9, ignore_eos=True)
    shared = small_engine(model, share_prefix=True, enable_prefix_caching=False)
    alone = small_engine(model, share_prefix=False, enable_prefix_caching=False)
    a, b = shared.generate([PROMPTS[2]], sampling), alone.generate([PROMPTS[2]], sampling)
    assert_same_completions(a, b)
    prompt_len = len(PROMPTS[2])
    assert shared.stats()["forward_tokens"] == prompt_len + 4 * 2
    assert alone.stats()["forward_tokens"] == 4 * (prompt_len + 2)
    assert shared.stats()["cow_copies"] == 3          # 11 tokens: the partial third page is copied 3 times
    cached = small_engine(model, share_prefix=True, enable_prefix_caching=True)
    assert_same_completions(cached.generate([PROMPTS[2]], sampling), a)
    assert cached.stats()["prefix_cache_hit_pages"] == 0
    assert_same_completions(cached.generate([PROMPTS[2]], sampling), a)    # the prompt's 2 full pages are cached
    assert cached.stats()["prefix_cache_hit_pages"] == 2


def test_seeds_by_index_or_by_content(model):
    engine = small_engine(model)
    by_index = SamplingParams(max_new_tokens=4, seed=1, ignore_eos=True)
    by_content = SamplingParams(max_new_tokens=4, seed=1, ignore_eos=True, seed_by="content")
    twice = engine.generate([PROMPTS[0], PROMPTS[0]], by_index)
    assert twice[0].tokens != twice[1].tokens          # different prompt indices, different seeds
    twice = engine.generate([PROMPTS[0], PROMPTS[0]], by_content)
    assert twice[0].tokens == twice[1].tokens


def test_generate_completions_equals_the_simple_loop_bit_for_bit(checkpoint):
    model, _ = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    kwargs = dict(tokenizer=tokenizer, n=3, max_new_tokens=8, temperature=0.8, top_p=0.95, seed=4, chat=True)
    prompts = ["What is 2 + 3?", "Say hello", "count to three"]
    want = simple_generate(model, prompts, **kwargs)
    got = generate_completions(model, prompts, **kwargs)
    fields = lambda c: (c.prompt, c.prompt_index, c.sample_index, c.prompt_tokens, c.tokens, c.text,  # noqa: E731
                        c.finish_reason)
    assert [fields(c) for c in got] == [fields(c) for c in want]
    for g, w in zip(got, want):
        assert_bitwise_equal(torch.tensor(g.logprobs), torch.tensor(w.logprobs), "logprobs")


def test_native_profile_runs_and_is_close_to_the_trainer(model):
    engine = small_engine(model, profile="native")
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, seed=2, ignore_eos=True))
    ref = trainer_logprobs(model, out, 1.0)
    for c, r in zip(out, ref):
        assert_close_report(torch.tensor(c.logprobs), r, atol=1e-4, rtol=1e-4, what="native vs strict trainer")


@pytest.mark.parametrize("enabled_before", [True, False])
def test_generate_pauses_the_garbage_collector_and_restores_it(model, monkeypatch, enabled_before):
    """generate()'s steps run with the cyclic collector off (a full collection inside a rollout is a host stall
    on one decode step); afterwards it is as it was, also when a step raises."""
    import gc
    engine = small_engine(model)
    seen = []
    step = engine._step

    def recording_step(*args, **kwargs):
        seen.append(gc.isenabled())
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "_step", recording_step)
    (gc.enable if enabled_before else gc.disable)()
    try:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert seen and not any(seen) and gc.isenabled() == enabled_before

        def failing_step(*args, **kwargs):
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine, "_step", failing_step)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
        assert gc.isenabled() == enabled_before and not engine.has_unfinished()
    finally:
        gc.enable()
