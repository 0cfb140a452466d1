"""FastAPI app: OpenAI-compatible `/v1/audio/speech` (+ voices, models, health, metrics).

Every error is {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status; validation errors are 400
(as vLLM does), unknown models 404, a full queue 429 with Retry-After, a warming / draining / dead engine 503.
CPU-side preparation (JSON validation, prompt building, reference encoding) runs off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import struct
from typing import Any

import numpy as np
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from drama3_jax.codec.audio_io import audio_bytes, pcm16
from drama3_jax.prompt import PromptError, normalize_text, split_long_text
from drama3_jax.sampling import SamplingParams
from serving.engine import Engine, QueueFull, Request, new_seed
from serving.protocol import OPENAI_VOICES, APIError, SpeechRequest, VoiceUpload
from serving.references import ReferenceResolver
from serving.voices import VoiceStore

log = logging.getLogger(__name__)
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


@dataclasses.dataclass
class ServerState:
    engine: Engine
    resolver: ReferenceResolver
    voices: VoiceStore
    served_model_name: str = "drama-3"
    model_description: str = "Fish Audio Drama 3"
    max_input_chars: int = 20_000
    benchmark_mode: bool = False
    api_key: str | None = None

    @property
    def sample_rate(self) -> int:
        return self.engine.codec.cfg.sample_rate


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def wav_stream_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown (0xFFFFFFFF) sizes, for streaming."""
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack(
        "<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="drama3-jax", version="0.1.0")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}"))

    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        return error_response(_from_validation(e.errors()))

    @app.middleware("http")
    async def _auth_and_request_id(request: HTTPRequest, call_next):
        if state.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                return error_response(APIError(401, "missing or invalid API key"))
        response = await call_next(request)
        if rid := request.headers.get("x-request-id"):
            response.headers["x-request-id"] = rid
        return response

    # ---------------------------------------------------------------------------------------- health
    @app.get("/health")
    async def health():
        eng = state.engine
        if eng.dead:
            return JSONResponse({"status": "dead", "error": eng.dead}, status_code=503)
        if not eng.ready or eng.draining:
            return JSONResponse({"status": "warming" if not eng.ready else "draining"}, status_code=503)
        return {"status": "ok", "active_streams": eng.active_count(), "queued": len(eng.waiting)}

    @app.get("/ping")
    async def ping():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.served_model_name, "object": "model", "owned_by": "drama3-jax",
                                            "created": 0, "description": state.model_description}]}

    # ---------------------------------------------------------------------------------------- voices
    @app.get("/v1/audio/voices")
    async def list_voices():
        return {"object": "list", "data": state.voices.list()}

    @app.post("/v1/audio/voices")
    async def upload_voice(request: HTTPRequest):
        body = await _json_body(request)
        try:
            up = VoiceUpload.model_validate(body)
        except ValidationError as e:
            raise _from_validation(e.errors()) from None
        name = state.voices.check_name(up.name)
        if name in OPENAI_VOICES:
            raise APIError(400, f"'{name}' is a built-in voice name", param="name")
        if not up.text.strip():
            raise APIError(400, "a voice needs the transcript of its audio", param="text")
        if (up.audio is None) == (up.codes is None):
            raise APIError(400, "give exactly one of 'audio' or 'codes'", param="audio")
        if up.audio is not None:
            codes = await run_in_threadpool(state.resolver.encode_audio, up.audio, "audio")
        else:
            codes = state.resolver.check_codes(up.codes, "codes")
        _check_text(up.text, "text")
        frame_rate = state.sample_rate / state.engine.codec.frame_length
        return state.voices.put(name, codes, up.text, frame_rate)

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str):
        if not state.voices.delete(name):
            raise APIError(404, f"voice '{name}' does not exist", param="name")
        return {"deleted": True, "name": name.lower()}

    # ---------------------------------------------------------------------------------------- speech
    @app.post("/v1/audio/speech")
    async def speech(request: HTTPRequest):
        eng = state.engine
        if eng.dead or not eng.ready or eng.draining:
            raise APIError(503, "the engine is not serving (warming up, draining or failed)",
                           headers={"Retry-After": "5"})
        body = await _json_body(request)
        try:
            sreq = SpeechRequest.model_validate(body)
        except ValidationError as e:
            raise _from_validation(e.errors()) from None
        if sreq.model is not None and sreq.model != state.served_model_name:
            raise APIError(404, f"The model `{sreq.model}` does not exist.", param="model")
        stream_format = sreq.stream_format or ("sse" if sreq.stream else None)
        streaming = stream_format is not None
        if streaming and sreq.response_format == "flac":
            raise APIError(400, "streaming supports response_format 'pcm' or 'wav'", param="response_format")
        if streaming and sreq.speed != 1.0:
            raise APIError(400, "speed must be 1.0 when streaming", param="speed")
        if sreq.sample_rate is not None and sreq.sample_rate != state.sample_rate:
            raise APIError(400, f"this model produces {state.sample_rate} Hz audio", param="sample_rate")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def sink(kind: str, payload: Any):
            loop.call_soon_threadsafe(out.put_nowait, (kind, payload))

        req = await run_in_threadpool(prepare_request, state, sreq, sink)
        try:
            await run_in_threadpool(eng.submit, req)
        except QueueFull:
            raise APIError(429, "too many queued requests; retry later", headers={"Retry-After": "1"}) from None
        except PromptError as e:
            raise APIError(400, str(e), param="input") from None
        except ValueError as e:
            raise APIError(400, str(e), param="input") from None
        except RuntimeError as e:
            raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
        if streaming:
            return StreamingResponse(_stream(state, req, out, sreq.response_format, stream_format),
                                     media_type="text/event-stream" if stream_format == "sse"
                                     else MEDIA_TYPES[sreq.response_format])
        chunks = []
        try:
            while True:
                kind, payload = await out.get()
                if kind == "audio":
                    chunks.append(payload)
                elif kind == "done":
                    break
                else:
                    raise APIError(500, f"speech generation failed: {payload}")
        finally:
            eng.cancel(req)
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        if sreq.speed != 1.0:
            audio = time_stretch(audio, sreq.speed)
        data = await run_in_threadpool(audio_bytes, audio, state.sample_rate, sreq.response_format)
        return Response(data, media_type=MEDIA_TYPES[sreq.response_format])

    return app


async def _json_body(request: HTTPRequest) -> Any:
    ctype = request.headers.get("content-type", "")
    if "json" not in ctype:
        raise APIError(400, "the request body must be JSON (Content-Type: application/json)")
    raw = await request.body()
    if len(raw) > 64 << 20:
        raise APIError(413, "request body larger than 64 MiB")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None


def _from_validation(errors) -> APIError:
    err = errors[0] if errors else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    msg = err.get("msg", "invalid request")
    msg = msg.removeprefix("Value error, ")
    return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=loc[0] if loc else None)


def _check_text(text: str, param: str) -> None:
    try:
        normalize_text(text)
    except PromptError as e:
        raise APIError(400, str(e), param=param) from None


def prepare_request(state: ServerState, sreq: SpeechRequest, sink) -> Request:
    """Validate everything about a speech request and resolve its references into an engine Request (the server runs
    it in a worker thread; experiments.ablate calls it directly). Raises APIError (4xx) on bad input."""
    if len(sreq.input) > state.max_input_chars:
        raise APIError(400, f"input is longer than {state.max_input_chars} characters", param="input")
    try:
        chunks = split_long_text(normalize_text(sreq.input))
    except PromptError as e:
        raise APIError(400, str(e), param="input") from None
    if not chunks:
        raise APIError(400, "Input text cannot be empty", param="input")
    sampling = _sampling(state, sreq)
    max_new = sreq.sampling_value("max_new_tokens")
    cap = state.engine.cfg.max_new_tokens
    if max_new is not None and not (isinstance(max_new, int) and 1 <= max_new <= cap):
        raise APIError(400, f"max_new_tokens must be an integer in [1, {cap}]", param="max_new_tokens")
    seed = sreq.sampling_value("seed")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**31):
        raise APIError(400, "seed must be an integer in [0, 2^31)", param="seed")
    ignore_eos, forced = sreq.sampling_value("ignore_eos"), sreq.sampling_value("forced_frames")
    if (ignore_eos or forced is not None) and not state.benchmark_mode:
        raise APIError(400, "ignore_eos / forced_frames need a server started with --benchmark-mode",
                       param="forced_frames" if forced is not None else "ignore_eos")
    if forced is not None and not (isinstance(forced, int) and 1 <= forced <= cap):
        raise APIError(400, f"forced_frames must be an integer in [1, {cap}]", param="forced_frames")
    return Request(chunks=chunks, references=_references(state, sreq), previous_takes=_previous_takes(state, sreq),
                   sampling=sampling, seed=seed if seed is not None else new_seed(),
                   max_frames=max_new or cap, sink=sink, ignore_eos=bool(ignore_eos), forced_frames=forced)


def _sampling(state: ServerState, sreq: SpeechRequest) -> SamplingParams:
    rp = sreq.sampling_value("repetition_penalty")
    if rp is not None and rp != 1.0:
        raise APIError(400, "repetition_penalty must be 1.0 for this model", param="repetition_penalty")
    defaults = SamplingParams()
    vals = {}
    for key in ("temperature", "top_p", "top_k"):
        v = sreq.sampling_value(key)
        want = int if key == "top_k" else (int, float)
        if v is not None and (isinstance(v, bool) or not isinstance(v, want)):
            raise APIError(400, f"{key} must be a number", param=key)
        vals[key] = getattr(defaults, key) if v is None else v
    try:
        return SamplingParams(float(vals["temperature"]), float(vals["top_p"]), int(vals["top_k"])).validate(
            state.engine.model_cfg.band_size)
    except ValueError as e:
        param = str(e).split(" ")[0]
        raise APIError(400, str(e), param=param) from None


def _references(state: ServerState, sreq: SpeechRequest) -> list[tuple[np.ndarray, str]]:
    res = state.resolver
    refs: list[tuple[np.ndarray, str]] = []
    voice = sreq.voice_name()
    if voice is not None and voice not in OPENAI_VOICES:
        got = state.voices.get(state.voices.check_name(voice)) if _valid_voice_name(voice) else None
        if got is None:
            raise APIError(400, f"unknown voice '{voice}'", param="voice")
        refs.append(got)
    if sreq.ref_audio is not None or sreq.ref_audio_codes is not None:
        if not (sreq.ref_text and sreq.ref_text.strip()):
            raise APIError(400, "Voice cloning requires 'ref_text' (transcript of the reference audio)",
                           param="ref_text")
        if sreq.ref_audio is not None and sreq.ref_audio_codes is not None:
            raise APIError(400, "give 'ref_audio' or 'ref_audio_codes', not both", param="ref_audio")
        codes = (res.check_codes(sreq.ref_audio_codes, "ref_audio_codes") if sreq.ref_audio_codes is not None
                 else res.encode_audio(sreq.ref_audio, "ref_audio"))
        _check_text(sreq.ref_text, "ref_text")
        refs.append((codes, sreq.ref_text))
    for i, item in enumerate(sreq.references or []):
        param = f"references[{i}]"
        sources = [x for x in (item.vq_codes, item.audio, item.data, item.audio_path) if x is not None]
        if len(sources) != 1:
            raise APIError(400, "each reference needs exactly one of vq_codes, audio, data, audio_path", param=param)
        if not item.text.strip():
            raise APIError(400, "each reference needs its transcript in 'text'", param=param)
        if item.vq_codes is not None:
            codes = res.check_codes(item.vq_codes, param)
        elif item.audio_path is not None:
            codes = res.encode_audio("file://" + item.audio_path.removeprefix("file://"), param)
        else:
            codes = res.encode_audio(item.audio or item.data, param)
        _check_text(item.text, param)
        refs.append((codes, item.text))
    if len(refs) > 8:
        raise APIError(400, "at most 8 references per request", param="references")
    return refs


def _valid_voice_name(name: str) -> bool:
    try:
        VoiceStore.check_name(name)
        return True
    except APIError:
        return False


def _previous_takes(state: ServerState, sreq: SpeechRequest) -> list[tuple[str, np.ndarray]]:
    takes = []
    for i, t in enumerate(sreq.previous_takes or []):
        param = f"previous_takes[{i}]"
        if (t.codes is None) == (t.audio is None):
            raise APIError(400, "each previous take needs exactly one of codes or audio", param=param)
        codes = (state.resolver.check_codes(t.codes, param) if t.codes is not None
                 else state.resolver.encode_audio(t.audio, param))
        _check_text(t.text, param)
        takes.append((t.text, codes))
    if len(takes) > 4:
        raise APIError(400, "at most 4 previous takes", param="previous_takes")
    return takes


async def _stream(state: ServerState, req: Request, out: asyncio.Queue, fmt: str, stream_format: str):
    """Chunked raw PCM / streaming WAV, or SSE speech.audio.delta / speech.audio.done events."""
    try:
        if stream_format == "audio" and fmt == "wav":
            yield wav_stream_header(state.sample_rate)
        while True:
            kind, payload = await out.get()
            if kind == "audio":
                pcm = pcm16(payload).tobytes()
                if stream_format == "sse":
                    event = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode(),
                             "response_format": "pcm"}
                    yield f"event: speech.audio.delta\ndata: {json.dumps(event)}\n\n".encode()
                else:
                    yield pcm
            elif kind == "done":
                if stream_format == "sse":
                    event = {"type": "speech.audio.done", "usage": payload}
                    yield f"event: speech.audio.done\ndata: {json.dumps(event)}\n\n".encode()
                return
            else:
                if stream_format == "sse":
                    event = {"type": "speech.audio.error", "error": {"message": str(payload),
                                                                      "type": "server_error", "param": None,
                                                                      "code": 500}}
                    yield f"event: speech.audio.error\ndata: {json.dumps(event)}\n\n".encode()
                return
    finally:
        state.engine.cancel(req)  # client gone or stream over: frees the slot at once (no-op when finished)


def time_stretch(audio: np.ndarray, speed: float, frame: int = 2048) -> np.ndarray:
    """Tempo change without pitch change: Hann-windowed overlap-add with the analysis hop scaled by `speed`."""
    if audio.size < frame or speed == 1.0:
        return audio
    hop_out = frame // 4
    hop_in = hop_out * speed
    win = np.hanning(frame).astype(np.float32)
    n = int((audio.size - frame) / hop_in) + 1
    out = np.zeros(n * hop_out + frame, np.float32)
    norm = np.zeros_like(out)
    for i in range(n):
        a = int(i * hop_in)
        out[i * hop_out:i * hop_out + frame] += audio[a:a + frame] * win
        norm[i * hop_out:i * hop_out + frame] += win
    return out / np.maximum(norm, 1e-3)
