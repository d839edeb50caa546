"""User-facing errors: each carries one plain sentence (str(e)) and optional details."""
from __future__ import annotations


class TritonChatError(Exception):
    """An error whose message is one sentence a user can act on (CLI prints it, GUI shows it)."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


class ModelFilesError(TritonChatError):
    """Model folder, config, weights or tokenizer missing, corrupt or not Qwen3.5."""


class ContextFullError(TritonChatError):
    """The prompt (or prompt + answer) does not fit the engine's context."""


class BackendUnavailableError(TritonChatError):
    """The requested backend cannot run here (no CUDA GPU, Triton cannot compile, ...)."""


class DownloadError(TritonChatError):
    """The model could not be downloaded (offline, hub error, cancelled, verification failed)."""
