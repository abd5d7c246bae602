"""The figure file a --plot flag names (`train eval`, `prep analyze-padding`), checked when
the flag is parsed, before the work it draws, which takes minutes: a format matplotlib
writes, in a folder that exists and takes a new file. Each failure is one line naming the
fix.

The value becomes the file ``savefig`` will write, so the command's "wrote" line names it:
a name without a suffix gets matplotlib's default format (``x`` and ``x.`` write ``x.png``).
"""

from __future__ import annotations

import os
import tempfile

import click

from prep.base.errors import DISK, disk_errno, first_line


class PlotFile(click.Path):
    """A ``click.Path`` to a figure matplotlib can write there (module docstring)."""

    def __init__(self):
        super().__init__(dir_okay=False)

    def convert(self, value, param, ctx):
        path = os.fspath(super().convert(value, param, ctx))
        try:
            import matplotlib
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            self.fail("needs matplotlib: pip install 'ping-pack[plots]'", param, ctx)
        kind = os.path.splitext(path)[1][1:]
        if not kind:  # savefig's rule
            kind = matplotlib.rcParams["savefig.format"]
            path = f"{path.rstrip('.')}.{kind}"
        if kind.lower() not in FigureCanvasBase.get_supported_filetypes():
            self.fail(f"{path}: matplotlib writes no .{kind} file; end the name in .png, "
                      ".pdf or .svg", param, ctx)
        folder = os.path.dirname(path) or "."
        if os.path.exists(folder) and not os.path.isdir(folder):
            self.fail(f"{path}: {folder} is a file, not a folder; name a file in a folder",
                      param, ctx)
        if not os.path.isdir(folder):
            self.fail(f"{path}: no such folder {folder}; make it first, or name a file in a "
                      "folder that exists", param, ctx)
        if os.path.isdir(path):
            self.fail(f"{path}: a folder; name a file", param, ctx)
        try:  # what savefig will do there: make a file (closing it removes it again)
            tempfile.NamedTemporaryFile(dir=folder, prefix=".plot-check-").close()
        except OSError as e:
            code = disk_errno(e)
            what = DISK[code][0] if code is not None else first_line(e)
            self.fail(f"{path}: {what}; name a file in a folder you can write", param, ctx)
        return path
