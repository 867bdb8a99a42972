"""`RequestText`: the engine's deltas -> text, finish reasons, the count of generated tokens, and `finished`."""

from ioattn.engine.sampling import SamplingParams
from ioattn.models.tokenizer import ByteTokenizer
from ioattn.server.detokenize import RequestText
from ioattn.server.transport import RequestDelta, SampleDelta

EOS = ByteTokenizer().eos_token_ids[0]


def delta(*samples, finished=False) -> RequestDelta:
    return RequestDelta("r", [SampleDelta(index, list(ids), None, reason, None) for index, ids, reason in samples],
                        finished, 1.0, 2.0 if finished else None, 0)


def request_text(**params) -> RequestText:
    return RequestText("r", [1, 2], SamplingParams(**params), ByteTokenizer(), [EOS], 512, 0.0)


def test_finished_once_every_sample_ended_and_counts_what_the_engine_generated():
    text = request_text(n=2, max_tokens=10, stop=["cd"])
    assert not text.finished
    assert text.apply(delta((0, b"abc", None), (1, b"xy", None))) == 5
    assert not text.finished and text.output().outputs[0].text == "ab"  # "c" may begin the stop string
    # Sample 0 meets "cd" here; the engine runs it on beside sample 1, and its tokens still count as generated.
    assert text.apply(delta((0, b"de", None), (1, b"z", None))) == 3
    assert not text.finished
    assert [c.finish_reason for c in text.output().outputs] == ["stop", None]
    assert text.apply(delta((0, b"f", None), (1, b"w", None))) == 2
    assert text.output().outputs[0].text == "ab"  # what came after the stop string is dropped
    assert text.apply(delta((1, [EOS], "stop"), finished=True)) == 1
    assert text.finished
    output = text.output()
    assert output.finished and [(c.text, c.finish_reason) for c in output.outputs] == [("ab", "stop"), ("xyzw", "stop")]


def test_an_engine_side_end_finishes_what_this_side_did_not():
    text = request_text(max_tokens=10)
    text.apply(delta((0, b"ab", None)))
    assert not text.finished
    assert text.apply(delta(finished=True)) == 0  # aborted in the engine: no tokens, the request is over
    assert text.finished and text.output().outputs[0].finish_reason == "abort"
