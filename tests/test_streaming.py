"""Streaming (specpass.generate(..., streamer=) and the HF hook): Hugging Face's streamer interface gets the
prompt, then each step's accepted tokens while the loop runs, then `end()`; the streamed text is the
output's, and what HF's own generate streams for the same prompt."""

import threading

import pytest
import torch
from transformers import TextIteratorStreamer

import specpass
from conftest import FIXED_BUDGET, tiny_model
from specpass.drafters import PromptLookup


class Recording(TextIteratorStreamer):
    """A TextIteratorStreamer that also records each `put` (its tokens), how many pieces of text it had
    finalized before each put, and whether `end` ran."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.puts: list[list[int]] = []
        self.texts_before_put: list[int] = []
        self.texts = 0
        self.ended = False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())
        self.texts_before_put.append(self.texts)
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.texts += 1
        super().on_finalized_text(text, stream_end)

    def end(self):
        self.ended = True
        super().end()


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8, "seed": 5}])
def test_a_consumer_thread_gets_every_token_in_order_while_generate_runs(default_model, cases, sampling):
    model, tokenizer = default_model
    prompt = cases[1][0]  # [1, P]
    streamer = Recording(tokenizer, skip_prompt=True, skip_special_tokens=True)
    chunks = []
    consumer = threading.Thread(target=lambda: chunks.extend(streamer))
    consumer.start()
    options = {"drafter": specpass.drafters.default_drafter(), "budget": FIXED_BUDGET}
    out = specpass.generate(model, prompt, max_new_tokens=40, streamer=streamer, options=options, **sampling)
    consumer.join(timeout=60)
    assert not consumer.is_alive() and streamer.ended
    new = out.sequences[0, prompt.shape[1] :].tolist()
    assert streamer.puts[0] == prompt[0].tolist()  # the prompt first, as HF's generate puts it
    assert [t for put in streamer.puts[1:] for t in put] == new  # every token once, in order
    assert len(streamer.puts) - 1 == len(out.stats.steps) + 1  # one put per step (and the prefill's token)
    assert streamer.texts_before_put[-1] > 0  # text was finalized, for the consumer, before the last step ended
    assert "".join(chunks) == tokenizer.decode(new, skip_special_tokens=True)
    alone = specpass.generate(model, prompt, max_new_tokens=40, options=options, **sampling)
    assert torch.equal(alone.sequences, out.sequences)  # streaming changes nothing


def test_the_streamed_text_is_what_hfs_own_generate_streams(default_model, cases):
    """Greedy, 40 new tokens: a TextIteratorStreamer given to specpass.generate, and one given to HF's
    generate with specpass's hook, receive the tokens and the text HF's own generate streams."""
    model, tokenizer = default_model
    prompt = cases[1][0]  # [1, P]
    settings = {"max_new_tokens": 40, "do_sample": False}
    options = {"drafter": specpass.drafters.default_drafter(), "budget": FIXED_BUDGET}
    runs = {
        "hf": lambda s: model.generate(prompt, attention_mask=torch.ones_like(prompt), streamer=s, **settings),
        "specpass": lambda s: specpass.generate(model, prompt, streamer=s, options=options, **settings),
        "hook": lambda s: model.generate(prompt, attention_mask=torch.ones_like(prompt), streamer=s,
                                         custom_generate=specpass.custom_generate(options), **settings),
    }  # fmt: skip
    streamed = {}
    for name, run in runs.items():
        streamer = Recording(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=0)  # read after the run
        run(streamer)
        assert streamer.ended, name
        streamed[name] = ([t for put in streamer.puts for t in put], "".join(streamer))
    assert len(streamed["hf"][0]) == prompt.shape[1] + 40
    assert streamed["specpass"] == streamed["hf"]
    assert streamed["hook"] == streamed["hf"]


def test_a_streamer_takes_one_sequence():
    model = tiny_model("llama")
    streamer = Recording(None)
    with pytest.raises(specpass.InvalidParameterError, match="a streamer follows one sequence"):
        specpass.generate(model, torch.randint(3, 96, (2, 5)), max_new_tokens=4, streamer=streamer,
                          options={"lowering": "eager", "drafter": PromptLookup()})  # fmt: skip
