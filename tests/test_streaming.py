"""Streaming (specpass.generate(..., streamer=)): Hugging Face's streamer interface gets the prompt, then
each step's accepted tokens while the loop runs, then `end()`; the streamed text is the output's."""

import threading

import pytest
import torch
from transformers import TextIteratorStreamer

import specpass
from conftest import FIXED_BUDGET, tiny_model
from specpass.drafters import PromptLookup


class Recording(TextIteratorStreamer):
    """A TextIteratorStreamer that also records each `put` (its tokens) and whether `end` ran."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())
        super().put(value)

    def end(self):
        self.ended = True
        super().end()


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8, "seed": 5}])
def test_a_consumer_thread_gets_every_token_in_order_while_generate_runs(default_model, cases, sampling):
    model, tokenizer = default_model
    prompt = cases[1][0]  # [1, P]
    streamer = Recording(tokenizer, skip_prompt=True, skip_special_tokens=True)
    chunks, first_chunk = [], {}

    def consume():
        for text in streamer:
            first_chunk.setdefault("at", len(streamer.puts))  # how many puts had run when text first came
            chunks.append(text)

    consumer = threading.Thread(target=consume)
    consumer.start()
    options = {"drafter": specpass.drafters.default_drafter(), "budget": FIXED_BUDGET}
    out = specpass.generate(model, prompt, max_new_tokens=40, streamer=streamer, options=options, **sampling)
    consumer.join(timeout=60)
    assert not consumer.is_alive() and streamer.ended
    new = out.sequences[0, prompt.shape[1] :].tolist()
    assert streamer.puts[0] == prompt[0].tolist()  # the prompt first, as HF's generate puts it
    assert [t for put in streamer.puts[1:] for t in put] == new  # every token once, in order
    assert len(streamer.puts) - 1 == len(out.stats.steps) + 1  # one put per step (and the prefill's token)
    assert first_chunk["at"] < len(streamer.puts)  # text reached the consumer before the last step's put
    assert "".join(chunks) == tokenizer.decode(new, skip_special_tokens=True)
    alone = specpass.generate(model, prompt, max_new_tokens=40, options=options, **sampling)
    assert torch.equal(alone.sequences, out.sequences)  # streaming changes nothing


def test_a_streamer_takes_one_sequence():
    model = tiny_model("llama")
    streamer = Recording(None)
    with pytest.raises(specpass.InvalidParameterError, match="a streamer follows one sequence"):
        specpass.generate(model, torch.randint(3, 96, (2, 5)), max_new_tokens=4, streamer=streamer,
                          options={"lowering": "eager", "drafter": PromptLookup()})  # fmt: skip
