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


def print_table(console: Any, table: Any) -> None:
    """Print a rich ``table`` on ``console`` without cutting a value short. On a terminal
    rich fits the table to its width; into a pipe or a file, where rich would assume 80
    columns and end wide values in an ellipsis, the table gets the width it needs."""
    if console.is_terminal:
        console.print(table)
        return
    needed = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    width = console.width
    console.width = max(width, needed)
    try:
        console.print(table)
    finally:
        console.width = width
