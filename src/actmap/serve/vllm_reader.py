"""``POST /v1/actmap/score`` on vLLM's own server: each answer read by vLLM itself.

The vLLM plugin's score route (``score_route: true``, `actmap.serve.vllm_plugin`) reads an
existing (prompt, answer) pair as one teacher-forced request to vLLM's engine client: prompt +
answer token ids as the prompt, ``max_tokens=1``, a request id that tells the workers where
the answer starts (`actmap.capture.vllm_engine.forced_request_id`) and a ``cache_salt`` of its
own. The workers record rows ``P-1 .. P+T-1`` of that prefill with the generation recorder
(chunked prefill, preemption), and the answer tokens' log-probs and entropies from the final
hidden states of those positions; `VllmReader` takes the rows as the middleware takes a
generated answer's (pushed by the recording worker, else ``actmap_take``) and scores them as a
generated answer's (`actmap.capture.vllm_rows.generation_from_payload`,
`actmap.serve.engine.Engine.score`). No model is loaded in the API server.

`VllmReader` stands where ``actmap serve``'s scoring batcher stands (`submit` a `ScoreJob`, get
a future of its `Answer`): vLLM's scheduler batches the readings with everything else it runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from actmap.capture.records import CaptureConfig
from actmap.capture.vllm_engine import read_ids, read_request
from actmap.capture.vllm_rows import generation_from_payload
from actmap.serve.answers import ScoreJob
from actmap.serve.batcher import QueueFull
from actmap.serve.engine import Answer, BatchTimings


class VllmReader:
    """Teacher-forced readings through vLLM's engine client (``plugin``: the `VllmPlugin`
    whose engine scores, whose ``taker`` fetches rows and whose ``pool`` runs the CPU work);
    at most ``max_queue`` readings at once (`QueueFull` beyond, the route's 429)."""

    def __init__(self, plugin, max_queue: int, on_read=None) -> None:
        self.plugin, self.max_queue, self.on_read = plugin, max_queue, on_read
        self.tasks: set[asyncio.Task] = set()

    @property
    def depth(self) -> int:
        return len(self.tasks)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def submit(self, job: ScoreJob) -> asyncio.Future:
        """Start reading ``job``; its future gets the scored `Answer` (raises `QueueFull`)."""
        if len(self.tasks) >= self.max_queue:
            raise QueueFull(f"{len(self.tasks)} answers are being read (limit {self.max_queue})")
        job.future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._read(job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return job.future

    async def _read(self, job: ScoreJob) -> None:
        try:
            answer = await self.read(job)
        except Exception as error:
            if not job.future.done():
                job.future.set_exception(error)
            return
        if not job.future.done():
            job.future.set_result(answer)

    async def read(self, job: ScoreJob) -> Answer:
        """One reading: tokenize (as `capture_answers`), one vLLM request, take, score."""
        from vllm import SamplingParams

        plugin = self.plugin
        engine = plugin.engine
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        config = CaptureConfig(max_context=engine.max_context)
        prompt_ids, answer_ids = await loop.run_in_executor(
            plugin.pool, read_ids, engine.thread_tokenizer, job.prompt, job.answer, config
        )
        request_id, inputs, _ = read_request(prompt_ids, answer_ids, plugin.ends, engine.tokenizer)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        base = inputs["cache_salt"]  # in the request id: the rows are found by it
        plugin.expect(base)  # pushed by the recording worker, or taken by RPC
        try:
            async for _ in plugin.client.generate(inputs, params, request_id):
                pass
            items = await plugin.rows(base, 1)
        finally:
            plugin.release(base)
        if len(items) != 1:
            raise RuntimeError(f"the workers returned {len(items)} readings for {request_id}")
        read_s = time.perf_counter() - started
        answer = await loop.run_in_executor(plugin.pool, self._score, job, items[0], started)
        if self.on_read is not None:
            self.on_read(BatchTimings(1, read_s, time.perf_counter() - started - read_s))
        return answer

    def _score(self, job: ScoreJob, item: dict, started: float) -> Answer:
        generation = generation_from_payload(item, self.plugin.engine.tokenizer, self.plugin.ends)
        return self.plugin.engine.score([job], [generation], started)[0]


# the in-process reader's KV block size: vLLM's CPU default (128) is longer than most chat
# prompts, so no prompt block could be shared; 32 (the CPU backend wants multiples of 32) keeps
# a chat template's system turn in whole blocks
READ_BLOCK_SIZE = 32


class InProcessReader:
    """The proxy's reader with ``--reader vllm``: each batch of existing answers read as
    teacher-forced requests to an in-process vLLM engine of the served weights
    (`actmap.capture.vllm_engine.VllmCapture.read`: the batch in flight together under vLLM's
    scheduler, each reading one prefill), then scored as `actmap.serve.answers.score_answers`
    scores a batch. Called by the scoring batcher's thread, like `score_answers`.

    Readings share cached prompt blocks (one ``cache_salt`` for all, blocks of
    `READ_BLOCK_SIZE`): a prefix every prompt starts with (the chat template's system turn, a
    system prompt) is computed once, as the transformers reader's `PrefixCache` does. A reading
    needs every row from its prompt's last position on computed, and vLLM skips whatever
    cached blocks cover: a block past that position is cached only by an earlier reading with
    the same prompt (and, but for a prompt that ends on a block boundary, the same first answer
    tokens). A skipped row stays all zeros, and hits cover leading positions only, so a reading
    whose first row is all zeros is read again with a salt of its own (``reread`` counts
    them)."""

    def __init__(self, capture, engine) -> None:
        self.capture, self.engine = capture, engine
        self.salt = f"actmap-readers-{uuid.uuid4().hex}"
        self.reread = 0

    @classmethod
    def build(cls, settings, engine, dtype: str) -> InProcessReader:
        from actmap.capture.vllm_engine import VllmCapture, VllmOptions
        from actmap.serve.loaded_run import refuse_what_vllm_cannot_read

        refuse_what_vllm_cannot_read(engine.detector, "read with --reader transformers")
        capture = VllmCapture(
            settings.model,
            dtype,
            VllmOptions(max_num_seqs=settings.max_batch, block_size=READ_BLOCK_SIZE),
            greybox=engine.detector.needs_scalars,
            max_context=engine.max_context,
        )
        return cls(capture, engine)

    def __call__(self, jobs: list[ScoreJob]) -> tuple[list[Answer], BatchTimings]:
        started = time.perf_counter()
        config = CaptureConfig(
            max_context=self.engine.max_context, **self.engine.detector.capture_settings()
        )
        prompts, answers = [job.prompt for job in jobs], [job.answer for job in jobs]
        generations = self.capture.read(prompts, answers, config, salt=self.salt)
        skipped = [i for i, g in enumerate(generations) if not row_computed(g)]
        if skipped:  # a cached block covered answer rows: those pairs again, computed anew
            self.reread += len(skipped)
            again = self.capture.read(
                [prompts[i] for i in skipped], [answers[i] for i in skipped], config
            )
            for i, generation in zip(skipped, again, strict=True):
                generations[i] = generation
        read = time.perf_counter()
        answers = self.engine.score(jobs, generations, started)
        return answers, BatchTimings(len(jobs), read - started, time.perf_counter() - read)

    def close(self) -> None:
        self.capture.close()


def row_computed(generation) -> bool:
    """Whether a reading's first row was computed (a row vLLM skipped holds zeros: its pooled
    states, of every layer; an empty answer's single row is its last position, which vLLM
    always computes)."""
    return generation.n_tokens == 0 or bool(generation.trajectory[:, 0].any())
