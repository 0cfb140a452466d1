"""asyncio + httpx streaming client: POST /v1/audio/speech (raw PCM) under a concurrency cap, recording every chunk's
arrival time and size."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

import httpx

from serving.bench.dataset import BenchRequest, forced_frames_for
from serving.bench.metrics import BYTES_PER_SAMPLE, Trace


@dataclasses.dataclass
class Sampling:
    """Protocol defaults: vLLM-Omni's published Drama 3 run."""

    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 30
    max_new_tokens: int = 500


def request_body(req: BenchRequest, sampling: Sampling, forced: bool, model: str | None) -> dict:
    """The JSON body: streaming raw s16le PCM, voice cloning from codes + transcript."""
    body = {"input": req.text, "ref_text": req.ref_text, "ref_audio_codes": req.ref_audio_codes,
            "stream": True, "stream_format": "audio", "response_format": "pcm",
            **dataclasses.asdict(sampling)}
    if model:
        body["model"] = model
    if forced:
        body["ignore_eos"] = True
        body["forced_frames"] = min(req.forced_frames or forced_frames_for(req.text), sampling.max_new_tokens)
    return body


async def one(client: httpx.AsyncClient, url: str, req: BenchRequest, body: dict, frame_samples: int) -> Trace:
    """Send one request and read its stream to the end; never raises (errors land in the trace)."""
    t = Trace(req.id, time.perf_counter())
    if "forced_frames" in body:
        t.expected_bytes = body["forced_frames"] * frame_samples * BYTES_PER_SAMPLE
    try:
        async with client.stream("POST", url, json=body) as r:
            t.status = r.status_code
            if r.status_code == 200:
                async for data in r.aiter_raw():
                    if data:
                        t.chunks.append((time.perf_counter(), len(data)))
            else:
                await r.aread()
    except (httpx.HTTPError, OSError) as e:
        t.error = type(e).__name__
    t.end = time.perf_counter()
    return t


async def run_batch(base_url: str, reqs: list[BenchRequest], concurrency: int, sampling: Sampling, forced: bool,
                    *, model: str | None = None, timeout: float = 600.0, frame_samples: int = 2048,
                    on_done: Callable[[Trace], None] | None = None) -> list[Trace]:
    """All requests, at most `concurrency` in flight, in order of submission; traces in the order of `reqs`."""
    url = base_url.rstrip("/") + "/v1/audio/speech"
    sem = asyncio.Semaphore(concurrency)
    bodies = [request_body(r, sampling, forced, model) for r in reqs]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        async def task(req, body):
            async with sem:
                t = await one(client, url, req, body, frame_samples)
            if on_done:
                on_done(t)
            return t

        return list(await asyncio.gather(*(task(r, b) for r, b in zip(reqs, bodies))))
