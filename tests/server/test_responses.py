"""Streaming chunks written without pydantic are, byte for byte, the JSON of the chunk models pydantic writes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ioattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ioattn.models.tokenizer import ByteTokenizer
from ioattn.server.responses import ChatFormatter, CompletionFormatter

# Control characters, quotes and backslashes, line and paragraph separators, non-BMP: every escaping rule.
TEXT = st.text(st.sampled_from([*map(chr, range(0x80)), "\u2028", "\u2029", "\ufffd", "é", "\U0001F600",
                                "\u0085"]), max_size=12)


def outputs(texts: list[str], reasons: list[str | None]) -> list[RequestOutput]:
    """Cumulative outputs of one sample: its text grows by each of `texts`, one token each."""
    result, text = [], ""
    for count, (piece, reason) in enumerate(zip(texts, reasons), start=1):
        text += piece
        completion = CompletionOutput(index=0, text=text, token_ids=list(range(count)), cumulative_logprob=None,
                                      logprobs=None, finish_reason=reason, stop_reason=None)
        result.append(RequestOutput("r", None, [1, 2], [completion], reason is not None, RequestMetrics(0.0)))
    return result


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4), reason=st.sampled_from(["stop", "length", "abort", None]),
       model=TEXT, chat=st.booleans(), prompt_index=st.integers(0, 2))
def test_chunks_without_logprobs_are_pydantics_json(texts, reason, model, chat, prompt_index):
    kind = ChatFormatter if chat else CompletionFormatter
    fast = kind("id-\"x\"", model, ByteTokenizer(), [3, 4, 5], 1, None, False)
    reasons = [None] * (len(texts) - 1) + [reason]
    for output in outputs(texts, reasons):
        sent = list(fast.sent_text), list(fast.sent_tokens)
        chunks = fast.chunks(output, prompt_index)
        completion = output.outputs[0]
        i = prompt_index
        text = completion.text[len(sent[0][i]):]
        expected = fast.chunk(i, completion, text, sent[1][i], len(completion.token_ids)).model_dump_json()
        assert chunks == [expected]
