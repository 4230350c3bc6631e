"""The simulated answers' logprobs: well formed for every token of the vocabulary."""

from replica.answers import Answer, AnswerSpec
from replica.api.tokenizer import ByteTokenizer


def test_no_token_lists_itself_or_a_repeat_among_its_alternatives():
    """A legacy completion keys top_logprobs by text: a repeat would shrink the dict."""
    tokenizer = ByteTokenizer()
    spec = AnswerSpec(request_id="r", model="m", chat=False, prompts=[0], logprobs=5)
    answer = Answer(spec, tokenizer, on_first_token=lambda: None)
    for position in range(3):
        logprobs = answer._logprobs(list(tokenizer.vocabulary), position, offset=0)
        assert all(len(top) == 6 for top in logprobs["top_logprobs"])
        for own, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
            assert sorted(top.values(), reverse=True)[0] == own
