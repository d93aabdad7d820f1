"""The exceptions of the PTC core; everything tenplex raises on bad input derives from `TenplexError`."""


class TenplexError(Exception):
    """Base class of every error tenplex reports to its users."""


class PTCError(TenplexError, ValueError):
    """An invalid tensor, box, mesh, placement or manifest."""
