"""``InputError`` under its older name, for the modules that still import it from here;
it lives in prep.base.errors."""

from prep.base.errors import InputError

__all__ = ["InputError"]
