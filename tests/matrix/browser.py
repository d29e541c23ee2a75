"""Opening a matrix HTML report in headless Chromium (Debian package `chromium`; `make apt` installs it)."""

from __future__ import annotations

import shutil
import subprocess


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def assert_renders(exe: str, path, min_cells: int) -> None:
    """Headless Chromium runs the page's script (it fills #render-check) and draws the plots."""
    done = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--dump-dom", f"file://{path}"], capture_output=True, text=True, timeout=120)
    dom = done.stdout
    assert "rendered: 3 plots" in dom, (done.returncode, done.stderr[-2000:], dom[:500])
    cells = int(dom.split("rendered: 3 plots, ")[1].split(" cells")[0])
    assert cells >= min_cells
    shot = path.parent / "shot.png"
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1400,2400", f"--screenshot={shot}", f"file://{path}"], capture_output=True,
                   timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000  # a page with plots, not a blank one
