"""Exceptions raised by Lily. Every error names the file, tensor or field it is about."""


class LilyError(Exception):
    """Base class of every error Lily raises on purpose."""


class CheckpointError(LilyError, ValueError):
    """A checkpoint folder, file, header, tensor or config field is missing, corrupt or unsupported."""


class ChatTemplateError(LilyError, ValueError):
    """A chat template failed to render (or raised through `raise_exception`)."""


class ContextOverflowError(LilyError, ValueError):
    """A prefill, step or restore would exceed the session's max_context. The session is unchanged."""


class SessionBusyError(LilyError, RuntimeError):
    """A session was used from two threads at once (a session runs one call at a time)."""


class BackendError(LilyError, RuntimeError):
    """The backend could not do what was asked: the OS refused a thread, a device failed. Names the call."""
