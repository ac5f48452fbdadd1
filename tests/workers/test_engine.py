"""Engine exactness against Hugging Face greedy generate, prefix reuse, preemption, aborts, limits."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.llm import LLM
from chunkserve.workers.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LlamaForCausalLM]:
    """A random-weight Llama of a non-default shape: 8 heads, 2 KV heads, head dim 128."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init, so that greedy picks are well separated
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    path = tmp_path_factory.mktemp("llama8x2") / "ckpt"
    model.save_pretrained(path)
    return str(path), model


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prompts_with_shared_prefixes(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    sys_a = [rng.randrange(1, 512) for _ in range(150)]
    sys_b = [rng.randrange(1, 512) for _ in range(70)]
    out = []
    for i in range(6):
        base = sys_a if i % 2 == 0 else sys_b
        out.append(base + [rng.randrange(1, 512) for _ in range(5 + 7 * i)])
    out.append(sys_a[:64])  # exactly one chunk, a prefix of others
    return out


@pytest.mark.parametrize("share", [True, False])
def test_greedy_matches_hf_generate_with_requests_joining_mid_run(hf_dir, share: bool) -> None:
    path, hf = hf_dir
    prompts = prompts_with_shared_prefixes()
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    core = EngineCore(EngineConfig(model=path, dtype="float32", chunk_size=16, share_prefix=share, num_kv_chunks=256,
                                   max_num_batched_tokens=96,
                                   attention_backend="torch" if share else "paged-torch"))
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or core.has_work():
        if pending:  # one new request every step: later ones join a running batch
            i, p = pending.pop(0)
            core.add_request(str(i), p, GREEDY)
        for out in core.step():
            got.setdefault(out.req.request_id, []).extend(out.token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    if share:
        assert core.stats()["prefix_cached_tokens"] > 0


def test_prefix_reuse_skips_the_cached_system_prompt(hf_dir) -> None:
    path, _ = hf_dir
    llm = LLM(model=path, chunk_size=64, num_kv_chunks=128)
    sys_prompt = [(7 * i) % 500 + 1 for i in range(1000)]
    first = llm.generate([sys_prompt + [3, 4, 5]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = llm.engine.runner.tokens_computed
    second = llm.generate([sys_prompt + [9, 9, 9, 9]], GREEDY)[0]
    ran = llm.engine.runner.tokens_computed - before
    assert second.num_cached_tokens >= 960
    assert ran == len(second.prompt_token_ids) - second.num_cached_tokens + GREEDY.max_tokens - 1


def test_a_prompt_reused_to_mid_chunk_in_a_fragmented_pool_matches_hf(hf_dir) -> None:
    """A prompt whose cached prefix ends inside a chunk (reuse down to the token copies that chunk's head)
    goes on in chunks that evictions of other prompts' cached chunks free all over the pool: its prefill
    spans several pool pieces, and its first new tokens see none of the later pieces' keys. The greedy
    output must still be HF's (an all-masked piece once counted as a real partial here)."""
    path, hf = hf_dir
    rng = random.Random(9)
    base = [rng.randrange(1, 512) for _ in range(100)]
    # fp32 (the default is bf16 on a CPU with native bf16): the log-probabilities are checked against HF's fp32
    llm = LLM(model=path, dtype="float32", chunk_size=16, num_kv_chunks=24, max_num_batched_tokens=512)
    llm.generate([base], GREEDY)  # 7 chunks, cached after it finishes
    for _ in range(8):  # fill the rest of the pool with other cached prompts (2 chunks each)
        llm.generate([[rng.randrange(1, 512) for _ in range(20)]], GREEDY)
    prompt = base[:90] + [rng.randrange(1, 512) for _ in range(60)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 90  # reused down to the token, into the middle of the sixth chunk
    assert out.token_ids == hf_greedy(hf, prompt, params.max_tokens)
    with torch.no_grad():  # the log-probabilities too: greedy picks alone hide small attention errors
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].double()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    err = float((torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs().max())
    assert err < 1e-4, (out.logprobs, ref)  # fp32 vs HF: 2e-6 here; the all-masked-piece bug gave 1.6e-3


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(hf_dir) -> None:
    path, _ = hf_dir
    prompts = prompts_with_shared_prefixes(seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # fp32: a preempted request is recomputed by prefill; in bf16 its decode steps of few rows run another kernel
    # (`B16Weight`) with other sum orders, so after a near tie its greedy path may differ (docs/ARCHITECTURE.md)
    roomy = LLM(model=path, dtype="float32", chunk_size=16, num_kv_chunks=512).generate(prompts, params)
    tight_llm = LLM(model=path, dtype="float32", chunk_size=16, num_kv_chunks=22, max_num_batched_tokens=64)
    tight = tight_llm.generate(prompts, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight_llm.stats()["num_preemptions"] > 0


def test_aborts_free_chunks_and_200_random_requests_leak_nothing(hf_dir) -> None:
    path, _ = hf_dir
    core = EngineCore(EngineConfig(model=path, chunk_size=16, num_kv_chunks=96, max_num_batched_tokens=128))
    rng = random.Random(1)
    live: list[str] = []
    for i in range(200):
        n = rng.randrange(1, 60)
        prefix = [5] * rng.choice([0, 16, 40])
        core.add_request(f"q{i}", prefix + [rng.randrange(1, 500) for _ in range(n)],
                         SamplingParams(max_tokens=rng.randrange(1, 6), temperature=rng.choice([0.0, 0.8]),
                                        seed=i))
        live.append(f"q{i}")
        if rng.random() < 0.5:
            for out in core.step():
                if out.finish_reason and out.req.request_id in live:
                    live.remove(out.req.request_id)
        if live and rng.random() < 0.3:
            core.abort(live.pop(rng.randrange(len(live))))
    for rid in live[::2]:
        core.abort(rid)
    while core.has_work():
        core.step()
    st = core.stats()
    assert st["num_sequences"] == 0 and st["kv_chunks_used"] == 0
    assert st["kv_chunks_free"] + st["kv_chunks_cached"] == st["kv_chunks_total"]
    assert core.cache.pool.num_free == st["kv_chunks_free"]


def test_too_long_prompt_fails_alone_and_others_finish(hf_dir) -> None:
    path, _ = hf_dir
    core = EngineCore(EngineConfig(model=path, chunk_size=16, num_kv_chunks=32, max_model_len=400))
    core.add_request("ok", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        core.add_request("long", list(range(1, 450)), GREEDY)
    with pytest.raises(ValueError, match="KV pool"):
        EngineCore(EngineConfig(model=path, chunk_size=16, num_kv_chunks=4)).add_request("big", [1] * 100, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        core.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError):
        core.add_request("oov", [100_000], GREEDY)
    finished = []
    while core.has_work():
        finished += [o.req.request_id for o in core.step() if o.finish_reason]
    assert finished == ["ok"]


@pytest.mark.parametrize("preempted_first", [False, True])
def test_a_request_that_outgrows_the_kv_pool_ends_with_length_and_the_queue_goes_on(hf_dir, preempted_first) -> None:
    """A pool smaller than the context: a request whose output would not fit even alone ends with "length" where
    the pool is full (it used to be preempted and never readmitted, holding every later request back)."""
    path, _ = hf_dir
    core = EngineCore(EngineConfig(model=path, chunk_size=16, num_kv_chunks=8, max_model_len=400))  # 128 tokens
    long_params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    if preempted_first:  # an older request makes it the preemption victim once the pool fills
        core.add_request("older", list(range(1, 40)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    core.add_request("grows", list(range(1, 101)), long_params)
    core.add_request("after", list(range(1, 16)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ends: dict[str, tuple[str, int]] = {}
    for _ in range(1000):
        if not core.has_work():
            break
        for o in core.step():
            if o.finish_reason:
                ends[o.req.request_id] = (o.finish_reason, len(o.req.output))
    assert not core.has_work()
    reason, n_out = ends["grows"]
    assert reason == "length" and 100 + n_out <= 8 * 16 + 1 and n_out < 100
    assert ends["after"] == ("length", 4)  # its max_tokens
    st = core.stats()
    assert st["num_sequences"] == 0 and st["kv_chunks_used"] == 0


def test_a_preempted_request_whose_context_no_longer_fits_the_pool_ends_instead_of_blocking_admission(hf_dir) -> None:
    path, _ = hf_dir
    core = EngineCore(EngineConfig(model=path, chunk_size=16, num_kv_chunks=8, max_model_len=400))  # 128 tokens
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    req = core.add_request("preempted", list(range(1, 101)), params)
    req.output = list(range(1, 41))  # as if preempted after 40 tokens (pins since took the pool's room, say)
    core.add_request("next", list(range(1, 16)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    outs = core.step()
    assert [(o.finish_reason, o.token_ids) for o in outs if o.req.request_id == "preempted"] == [("length", [])]
    ends = {o.req.request_id: o.finish_reason for o in outs if o.finish_reason and o.req.request_id != "preempted"}
    while core.has_work():
        ends.update({o.req.request_id: o.finish_reason for o in core.step() if o.finish_reason})
    assert ends == {"next": "length"}


def test_a_prompt_that_fills_the_pool_is_admitted_though_its_first_tokens_match_part_of_a_cached_chunk() -> None:
    """Admission counted the partly matching chunk's copy as one chunk more than the request uses, so a prompt
    that fits the pool exactly waited forever once a chat sharing its first tokens was cached."""
    core = EngineCore(EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=8, max_model_len=256,
                                   num_threads=1))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    head = [1, 2, 3, 4, 5]  # e.g. a chat template's first tokens
    core.add_request("warm", head + list(range(100, 120)), one)
    while core.has_work():
        core.step()
    big = core.add_request("big", head + list(range(200, 322)), one)  # 127 tokens + 1: the whole pool
    for _ in range(50):
        if not core.has_work():
            break
        core.step()
    assert big.finish_reason == "length" and len(big.output) == 1 and big.num_cached == 5


def test_seeded_sampling_is_reproducible_and_stop_token_ids_stop(hf_dir) -> None:
    path, _ = hf_dir
    llm = LLM(model=path, chunk_size=16, num_kv_chunks=64)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    a = llm.generate([[1, 2, 3, 4]], p)[0].token_ids
    b = llm.generate([[1, 2, 3, 4]], p)[0].token_ids
    assert a == b and len(a) == 12
    stop_at = a[3]
    first = a.index(stop_at)
    c = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50,
                                                     seed=42, stop_token_ids=(stop_at,)))[0]
    assert c.token_ids == a[:first + 1] and c.finish_reason == "stop"


def test_fully_cached_prompt_stays_shared_and_runs_its_last_token_for_logits_only(hf_dir) -> None:
    path, hf = hf_dir
    prompt = [(11 * i) % 500 + 1 for i in range(64)]  # exactly 4 chunks of 16
    expected = hf_greedy(hf, prompt, GREEDY.max_tokens)
    core = EngineCore(EngineConfig(model=path, dtype="float32", chunk_size=16, num_kv_chunks=64))
    for rid in ("first", "second"):
        core.add_request(rid, prompt, GREEDY)
    got: dict[str, list[int]] = {}
    peak_used = 0
    while core.has_work():
        for out in core.step():
            got.setdefault(out.req.request_id, []).extend(out.token_ids)
        peak_used = max(peak_used, core.stats()["kv_chunks_used"])
    assert got["first"] == expected and got["second"] == expected
    # 4 shared prompt chunks + one decode chunk per request (10 tokens each): no private prompt copy
    assert peak_used == 4 + 2
    core.add_request("third", prompt, GREEDY)
    before = core.runner.tokens_computed
    while core.has_work():
        for out in core.step():
            got.setdefault(out.req.request_id, []).extend(out.token_ids)
    assert got["third"] == expected
    assert core.runner.tokens_computed - before == GREEDY.max_tokens  # the logits-only row + 9 decodes


def test_prepack_weights_option_controls_the_packed_copy_and_outputs_agree(hf_dir) -> None:
    path, _ = hf_dir
    prompts = prompts_with_shared_prefixes(4)[:3]
    plain = LLM(model=path, dtype="float32", chunk_size=16, num_kv_chunks=64, prepack_weights=False)
    assert plain.engine.model._packed is None
    packed = LLM(model=path, dtype="float32", chunk_size=16, num_kv_chunks=64)
    if packed.engine.model._packed is None:
        pytest.skip("this CPU/ATen build has no oneDNN packed linear")
    assert [o.token_ids for o in packed.generate(prompts, GREEDY)] == [
        o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_requests_queue_by_their_frontend_arrival_stamp_not_by_when_they_reach_the_engine(hf_dir) -> None:
    path, _ = hf_dir
    core = EngineCore(EngineConfig(model=path, chunk_size=16, num_kv_chunks=64, max_num_seqs=1))
    now = time.time()
    core.add_request("late", [3] * 20, GREEDY, arrival_time=now)
    core.add_request("early", [4] * 20, GREEDY, arrival_time=now - 2.0)  # held up upstream for 2 s
    core.add_request("future", [5] * 20, GREEDY, arrival_time=now + 100.0)  # a skewed clock counts as now
    core.add_request("ancient", [6] * 20, GREEDY, arrival_time=now - 10_000.0)  # counted as MAX_QUEUE_AGE_S
    first: list[str] = []
    while core.has_work():
        for out in core.step():
            if out.req.request_id not in first and out.req.output:
                first.append(out.req.request_id)
    assert first == ["ancient", "early", "late", "future"]
    assert core.scheduler.num_preemptions == 0


@pytest.mark.parametrize("head_dim", [24, 40])
def test_head_dims_off_the_cpu_kernels_vector_width_match_hf_greedy(tmp_path, head_dim: int) -> None:
    """Head dims that are not a multiple of 16 (AVX-512) or 8 (AVX2) take the torch path, not the fused
    decode layer, whose whole-vector loops read past such a head (wrong tokens from the second one on)."""
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(tmp_path / "ckpt")
    rng = random.Random(head_dim)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (5, 21, 40)]
    llm = LLM(model=str(tmp_path / "ckpt"), dtype="float32", chunk_size=16, num_kv_chunks=64, warmup=False)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
