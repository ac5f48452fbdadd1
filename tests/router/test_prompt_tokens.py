"""The ingress's chat token cache: a shared head's ids reused, always the ids of the whole text tokenised."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from chunkserve.router.prompt_tokens import ChatTokenCache

TRICKY = ["", " ", "  hi", "\n\nx", "x\n", " <|im_end|> y", "[INST] z [/INST]", "日本語 ", "\t tab", "a" * 40,
          "Policy 3 of acme?", " ", "¿qué?", "emoji 🙂 ", "trailing space "]
SYSTEM = " ".join(f"Policy {i}: answer politely and cite policy number {i}." for i in range(40))


def direct(tok: Any, msgs: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def conversations(seed: int, n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": SYSTEM + rng.choice(TRICKY)}]
        for _ in range(rng.randint(0, 2)):
            msgs += [{"role": "user", "content": rng.choice(TRICKY)}, {"role": "assistant", "content": rng.choice(TRICKY)}]
        out.append([*msgs, {"role": "user", "content": rng.choice(TRICKY) + rng.choice(TRICKY)}])
    return out


@pytest.fixture(scope="module")
def smollm() -> Any:
    from chunkserve.workers.weights import embedded_checkpoint_dir

    return PreTrainedTokenizerFast.from_pretrained(str(embedded_checkpoint_dir(progress=False)), local_files_only=True)


def metaspace_tokenizer(rstrip: bool = False) -> PreTrainedTokenizerFast:
    """A small BPE whose pre-tokenizer prepends ``▁`` to a text's first section only (Llama-2 style)."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [SYSTEM, *TRICKY, "hello world the policy answer cite number politely"] * 3
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    tk.add_special_tokens([AddedToken("[INST]", special=True, normalized=False),
                           AddedToken("[/INST]", special=True, normalized=False, rstrip=rstrip)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}</s>"
                         "{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}")
    return tok


def test_cached_ids_equal_the_whole_chat_tokenised_and_each_head_is_tokenised_once(smollm: Any) -> None:
    cache = ChatTokenCache(smollm)
    convs = conversations(0, 120)
    for msgs in convs:
        assert cache.encode_chat(msgs) == direct(smollm, msgs)
    heads = {smollm.apply_chat_template(m[:-1], tokenize=False) for m in convs}
    assert cache.misses == len(heads) and cache.hits == len(convs) - len(heads) > 0


def test_a_first_section_pre_tokenizer_gets_the_same_ids_as_the_whole_text() -> None:
    tok = metaspace_tokenizer()
    cache = ChatTokenCache(tok)
    assert cache.enabled
    naive_differs = False
    for msgs in conversations(1, 80):
        want = direct(tok, msgs)
        assert cache.encode_chat(msgs) == want
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        cut = text.rindex("[/INST]", 0, len(tok.apply_chat_template(msgs[:-1], tokenize=False))) + len("[/INST]")
        naive = list(tok.encode(text[:cut], add_special_tokens=False)) + list(tok.encode(text[cut:], add_special_tokens=False))
        naive_differs |= naive != want
    assert cache.hits > 0
    assert naive_differs  # the rest tokenised alone would be a first section: the cache tokenises it behind [/INST]


def test_a_special_token_that_strips_whitespace_is_never_split_after() -> None:
    tok = metaspace_tokenizer(rstrip=True)  # "[/INST]" eats the whitespace after it
    cache = ChatTokenCache(tok)
    heads: list[str] = []
    head_ids = cache._head_ids
    cache._head_ids = lambda h, t: heads.append(h) or head_ids(h, t)  # type: ignore[method-assign]
    for msgs in conversations(2, 30):
        assert cache.encode_chat(msgs) == direct(tok, msgs)
    assert heads and all(h.endswith("</s>") for h in heads)  # split after an assistant turn, never after [/INST]


def test_a_template_that_renders_the_last_message_apart_tokenises_the_whole_text(smollm: Any) -> None:
    tok = PreTrainedTokenizerFast(tokenizer_object=smollm.backend_tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{% if loop.last %}final{% else %}{{ m.role }}{% endif %}"
                         "\n{{ m.content }}<|im_end|>\n{% endfor %}")
    cache = ChatTokenCache(tok)
    for msgs in conversations(3, 20):
        assert cache.encode_chat(msgs) == direct(tok, msgs)
    assert cache.hits == cache.misses == 0


def test_the_head_cache_keeps_at_most_its_entries(smollm: Any) -> None:
    cache = ChatTokenCache(smollm, max_entries=2)
    for i in range(6):
        msgs = [{"role": "system", "content": f"{SYSTEM} tenant {i}"}, {"role": "user", "content": "hi"}]
        assert cache.encode_chat(msgs) == direct(smollm, msgs)
    assert len(cache._heads) == 2 and cache.misses == 6


def test_a_cache_control_prefix_is_the_head_its_chats_cached(smollm: Any) -> None:
    cache = ChatTokenCache(smollm)
    system = [{"role": "system", "content": SYSTEM}]
    chat = [*system, {"role": "user", "content": " Where is my order?"}]
    assert cache.encode_chat(chat) == direct(smollm, chat)
    want = list(smollm.encode(smollm.apply_chat_template(system, tokenize=False), add_special_tokens=False))
    assert cache.encode_prefix(system) == want
    assert (cache.misses, cache.hits) == (1, 1)
    assert cache.encode_chat(chat)[:len(want)] == want  # the pin covers the prompt's leading tokens


def test_special_tokens_that_overlap_another_are_never_split_after() -> None:
    tok = metaspace_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<x|", "|y>", "|y>!"]})  # "<x|" ends where "|y>" begins
    split = ChatTokenCache(tok)._split
    assert "[INST]" in split and "[/INST]" in split
    assert not {"<x|", "|y>", "|y>!"} & set(split)
