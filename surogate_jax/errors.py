"""Exception types users can catch; command-line entry points turn them into one `error:` line."""


class SurogateError(Exception):
    """Base class of every error surogate_jax raises on purpose (user input, files, configs)."""


class ModelLoadError(SurogateError):
    """A model directory, hub id, config.json or weight file cannot be loaded; says what and where."""


class UnsupportedConfigError(ModelLoadError):
    """An HF config asks for math we do not implement; the message names the field."""
