"""Stop strings: end an answer at the first occurrence of a text such as a newline.

Few-shot prompts teach a model the "Question: ... Answer: ..." format, and a
model that has learned it goes on, after its answer, with an invented next
question. A stop string ends the row there, so the answer, its trajectory and
its map cover the answer only, and the batch finishes as soon as every row has
answered.

Rule, shared by capture and by the sampling baselines: the answer text is cut
before the first stop string; answer token ``k`` stays when its text starts
before the cut (``len(decode(tokens[:k])) < cut``), so a token that carries
answer text and then the stop string stays in, and the tokens of the stop
string itself are dropped like an end-of-sequence token. With
``skip_leading_whitespace`` a stop string inside the answer's leading
whitespace does not count (an answer that opens with a newline is not empty).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actmap.errors import ActmapUserError


def check_stop_strings(stop_strings: Sequence[str]) -> tuple[str, ...]:
    stops = tuple(stop_strings)
    if any(not isinstance(s, str) or not s for s in stops):
        raise ActmapUserError(f"stop_strings must be non-empty strings, got {stops!r}")
    return stops


def stop_position(
    text: str, stop_strings: Sequence[str], skip_leading_whitespace: bool = False
) -> int | None:
    """Index in ``text`` where the first stop string begins, or None."""
    start = len(text) - len(text.lstrip()) if skip_leading_whitespace else 0
    hits = [i for s in stop_strings if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def cut_at_stop(
    token_ids: Sequence[int],
    tokenizer,
    stop_strings: Sequence[str],
    skip_leading_whitespace: bool = False,
) -> tuple[int, str, bool]:
    """(answer tokens kept, answer text before the stop string, whether a stop string cut it).

    ``token_ids`` must end before any end-of-sequence token. Without a stop string
    every token is kept and the text is the whole decoded answer.
    """
    ids = list(token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = stop_position(text, stop_strings, skip_leading_whitespace)
    if cut is None:
        return len(ids), text, False
    kept = sum(
        1 for k in range(len(ids)) if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) < cut
    )
    return kept, text[:cut], True


def end_token_ids(*sources) -> set[int]:
    """End-of-sequence ids named by ``sources`` (a generation config, a tokenizer; None is
    skipped): each one's ``eos_token_id``, an int or a list. The one rule of both engines
    (`actmap.capture.generate.stop_ids`, `actmap.capture.vllm_engine.end_ids`)."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


def cut_row(
    generated: Sequence[int], ends: set[int], tokenizer, stop_strings: Sequence[str] | None
) -> tuple[list[int], str, bool, bool]:
    """Where one generated row's answer ends (the per-row cut of both engines): the row up to
    its first end token, then `end_answer`'s stop-string rule. Returns (answer tokens, answer
    text, stopped, has_stop_step); ``generated[len(answer tokens)]`` is the stop step when
    ``has_stop_step``."""
    generated = list(generated)
    n = next((k for k, token in enumerate(generated) if token in ends), len(generated))
    return end_answer(generated[:n], n < len(generated), tokenizer, stop_strings)


def stop_step_extras(logprobs, entropies, n: int, has_stop_step: bool) -> dict:
    """The stop step's grey-box statistics (``Generation.extras``): the log-prob and entropy
    of step ``n`` when a step produced the stop and the row is grey-box, else nothing."""
    if not has_stop_step or logprobs is None:
        return {}
    return {"eos_logprob": float(logprobs[n]), "eos_entropy": float(entropies[n])}


def end_answer(
    token_ids: Sequence[int], ended: bool, tokenizer, stop_strings: Sequence[str] | None
) -> tuple[list[int], str, bool, bool]:
    """Where one generated answer ends: (answer tokens, answer text, stopped, has_stop_step).

    ``token_ids`` are the tokens before any end-of-sequence token and ``ended`` says whether
    one followed. A stop string cuts the answer at its first token; ``has_stop_step`` says
    whether a generated step beyond the answer produced the stop (an end token, or a stop
    string's first token), so its statistics are kept - unless the last answer token
    carries the stop string itself, when no step produced a stop token.
    """
    token_ids = list(token_ids)
    if not stop_strings:
        return token_ids, tokenizer.decode(token_ids, skip_special_tokens=True), ended, ended
    kept, answer, cut = cut_at_stop(
        token_ids, tokenizer, stop_strings, skip_leading_whitespace=True
    )
    stopped = ended or cut
    has_stop_step = kept < len(token_ids) or (not cut and stopped)
    return token_ids[:kept], answer, stopped, has_stop_step


def stop_criteria(
    tokenizer,
    stop_strings: Sequence[str],
    prompt_len: int,
    skip_leading_whitespace: bool = False,
):
    """A ``StoppingCriteriaList`` ending each row once its generated text holds a stop string.

    Cheaper than transformers' own ``stop_strings``, which rebuilds a table over the whole
    vocabulary on every call. None when there are no stop strings.
    """
    if not stop_strings:
        return None
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnStrings(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            texts = tokenizer.batch_decode(input_ids[:, prompt_len:], skip_special_tokens=True)
            done = [
                stop_position(t, stop_strings, skip_leading_whitespace) is not None for t in texts
            ]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopOnStrings()])
