"""Request/response schemas of the OpenAI-compatible speech API and the OpenAI-style error envelope.

`POST /v1/audio/speech` accepts vLLM-Omni's and SGLang-Omni's field names (serving-contract.md 1.1): sampling values
at top level or inside `extra_params` (top level wins), references as `ref_audio`/`ref_text`, `ref_audio_codes`
([10][T] ints), or a `references` list, and `previous_takes` for multi-turn revision.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's built-in voice names: they mean "no reference" so the official client works unchanged.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                           "verse", "marin", "cedar", "default"})
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "repetition_penalty", "ignore_eos",
                 "forced_frames")


class APIError(Exception):
    """An error returned to the client as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.type = type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                              413: "RequestTooLargeError", 429: "RateLimitError",
                              503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class ReferenceItem(BaseModel):
    """One voice reference: audio (base64 / data URI / allowed file://) or pre-encoded codes, plus its transcript."""

    model_config = ConfigDict(extra="forbid")
    audio: str | None = None
    audio_path: str | None = None
    data: str | None = None
    media_type: str | None = None
    vq_codes: list[list[int]] | None = None
    text: str = ""


class PreviousTake(BaseModel):
    """A previous take of this conversation (multi-turn revision): its text and its audio or codes."""

    model_config = ConfigDict(extra="forbid")
    text: str
    codes: list[list[int]] | None = None
    audio: str | None = None


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str
    model: str | None = None
    voice: str | dict | None = None
    response_format: Literal["wav", "pcm", "flac"] = "wav"
    stream: bool = False
    stream_format: Literal["audio", "sse"] | None = None
    speed: float = Field(1.0, ge=0.25, le=4.0)
    sample_rate: int | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    ref_audio_codes: list[list[int]] | None = None
    references: list[ReferenceItem] | None = None
    previous_takes: list[PreviousTake] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    extra_params: dict[str, Any] | None = None
    # benchmark mode only (server started with --benchmark-mode)
    ignore_eos: bool | None = None
    forced_frames: int | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("Input text cannot be empty")
        return v

    def sampling_value(self, key: str):
        """Top-level value, else the one in extra_params, else None."""
        v = getattr(self, key)
        if v is None and self.extra_params:
            v = self.extra_params.get(key)
        return v

    def voice_name(self) -> str | None:
        v = self.voice
        if isinstance(v, dict):
            v = v.get("id") or v.get("name")
        return v.strip().lower() if isinstance(v, str) and v.strip() else None


class VoiceUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    text: str
    audio: str | None = None
    codes: list[list[int]] | None = None
