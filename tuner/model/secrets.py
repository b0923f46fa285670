"""The tuner's name for the one secrets module, ``tuner.portable.secrets`` (standard library only, so
that the launcher masks with the same list, mask and digest): see there."""

from tuner.portable.secrets import (
    DEFAULT,
    ENV_NAMES,
    ENV_WORDS,
    FLAG_NAME,
    FLAGS,
    MASK,
    MIN_TEXT_LENGTH,
    Redactor,
    digest,
    digest_matches,
    encodings,
    normalize_flag,
    url_secrets,
)

__all__ = ["DEFAULT", "ENV_NAMES", "ENV_WORDS", "FLAGS", "FLAG_NAME", "MASK", "MIN_TEXT_LENGTH", "Redactor",
           "digest", "digest_matches", "encodings", "normalize_flag", "url_secrets"]
