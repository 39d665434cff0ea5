"""Chat templates, R1 <think> splitting, and a conversation's history handling."""

from __future__ import annotations

import random

import pytest

from dsq.runtime.chat_template import (CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, ThinkSplitter,
                                       pick_template, prompt_opens_think, strip_think)
from dsq.runtime.generate import StopMatcher, TokenEvent
from dsq.runtime.sampling import SamplingParams

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]

# DeepSeek-R1-Distill's template (abridged from its tokenizer_config.json): drops the thinking of
# earlier replies and opens a <think> block for the new one.
R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def test_gemma_fallback_matches_gemma_turn_format():
    t = ChatTemplate(GEMMA_TEMPLATE, "fallback:gemma3", "<bos>")
    assert t.render(CONV) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                              "<start_of_turn>model\nHello!<end_of_turn>\n"
                              "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    assert not t.render(CONV, add_generation_prompt=False).endswith("<start_of_turn>model\n")


def test_chatml():
    t = ChatTemplate(CHATML_TEMPLATE, "x")
    assert t.render(CONV[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_pick_template_prefers_the_models_own():
    assert pick_template("{{ 'x' }}", "gemma3", lambda t: False, "", "").origin == "model"
    assert pick_template(None, "gemma3", lambda t: False, "", "").origin == "fallback:gemma3"
    assert pick_template(None, "llama", lambda t: t == "<|start_header_id|>", "", "").origin == "fallback:llama3"
    assert pick_template(None, "llama", lambda t: False, "", "").origin == "fallback:plain"


def test_template_errors_are_user_errors():
    from dsq.errors import DsqError

    t = ChatTemplate("{{ raise_exception('no system role') }}", "model")
    with pytest.raises(DsqError, match="no system role"):
        t.render(CONV)


def test_r1_template_opens_think():
    t = ChatTemplate(R1_TEMPLATE, "model", "<bos>")
    p = t.render([{"role": "user", "content": "2+2?"}])
    assert prompt_opens_think(p)
    p2 = t.render([{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                   {"role": "user", "content": "3+3?"}])
    assert "add" not in p2 and "4<｜end▁of▁sentence｜>" in p2


def random_chunks(text: str, n: int, seed: int) -> list[str]:
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), n))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("seed", range(20))
def test_think_splitter_any_chunking(seed):
    chunks = random_chunks("<think>\nweigh options\n</think>\n\nThe answer is 4. <think>again</think>done", 8, seed)
    sp = ThinkSplitter()
    parts = [p for c in chunks for p in sp.feed(c)] + sp.flush()
    think = "".join(s for k, s in parts if k == "think")
    answer = "".join(s for k, s in parts if k == "answer")
    assert think == "\nweigh options\nagain"
    assert answer == "\n\nThe answer is 4. done"


def test_think_splitter_starting_inside():
    sp = ThinkSplitter(start_thinking=True)
    parts = sp.feed("hmm</thi") + sp.feed("nk>ok") + sp.flush()
    assert parts == [("think", "hmm"), ("answer", "ok")]
    assert strip_think("<think>\nx\n</think>\n\nY") == "Y"


@pytest.mark.parametrize("seed", range(10))
def test_stop_matcher_any_chunking(seed):
    chunks = random_chunks("alpha beta STOP gamma", 6, seed)
    sm = StopMatcher(["STOP", "never"])
    out, stopped = "", False
    for c in chunks:
        s, stopped = sm.feed(c)
        out += s
        if stopped:
            break
    assert stopped and out == "alpha beta "


class FakeModel:
    """A stand-in backend that replays scripted replies (the conversation logic is under test)."""

    arch, n_ctx, add_bos, bos_token, eos_token = "qwen2", 4096, False, "", ""

    def __init__(self, replies, template=CHATML_TEMPLATE, interrupt_after=None):
        self.replies, self.template, self.prompts = list(replies), template, []
        self.interrupt_after = interrupt_after

    def chat_template(self):
        return self.template

    def has_token(self, text):
        return False

    def tokenize(self, text, add_bos=True, special=True):
        return list(text.encode())[: 10_000]

    def stream(self, ids, sampling, max_tokens, stats=None, ignore_eos=False):
        self.prompts.append(bytes(ids).decode())
        reply = self.replies.pop(0)
        for i, ch in enumerate(reply):
            if self.interrupt_after is not None and i == self.interrupt_after:
                raise KeyboardInterrupt
            yield TokenEvent(0, ch)


def test_conversation_keeps_history_and_strips_thinking():
    from dsq.runtime.conversation import Conversation

    m = FakeModel(["<think>\nsum\n</think>\n\nFour.", "Six."])
    s = Conversation(m, sampling=SamplingParams(temperature=0))
    seen = []
    s.send("2+2?", lambda k, t: seen.append((k, t)))
    assert "".join(t for k, t in seen if k == "think") == "\nsum\n"
    assert "".join(t for k, t in seen if k == "answer").strip() == "Four."
    s.send("3+3?")
    assert "2+2?" in m.prompts[1] and "Four." in m.prompts[1] and "sum" not in m.prompts[1]
    s.reset()
    assert s.messages == []


def test_conversation_keeps_interrupted_reply():
    from dsq.runtime.conversation import Conversation

    m = FakeModel(["abcdef"], interrupt_after=3)
    s = Conversation(m)
    with pytest.raises(KeyboardInterrupt):
        s.send("go")
    assert s.messages[-1] == {"role": "assistant", "content": "abc"}


def test_conversation_drops_oldest_turns_when_context_is_full():
    from dsq.runtime.conversation import Conversation

    m = FakeModel(["x" * 10] * 6)
    m.n_ctx = 200
    s = Conversation(m, max_tokens=64)
    for i in range(5):
        s.send(f"message number {i}")
    last = m.prompts[-1]
    assert "message number 4" in last and "message number 0" not in last
    assert len(last) <= m.n_ctx - 64
