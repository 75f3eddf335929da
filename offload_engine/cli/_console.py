"""What the commands share on the terminal."""

from __future__ import annotations

from typing import Any


def progress_bar(console: Any) -> Any:
    """A rich progress bar on ``console`` (stderr), shown only on a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
