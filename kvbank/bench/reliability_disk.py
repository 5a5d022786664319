"""Disk faults for ``kvbank bench reliability``: rotten frames and a small file system.

- :func:`rot_values` — flips bytes inside a share of the frames of a closed data dir,
  where each lies (:func:`kvbank.tiers.diskfile.frame_spans`: a segment file, or
  ``data.mdb`` for a row of the older layout), with plain file writes. Neither LMDB nor
  the tier sees the change, exactly like rot under a closed data dir.
- :class:`SmallFs` — a file system of a few MiB at a folder: ``tmpfs`` mounted there,
  or, where tmpfs cannot be mounted, an ext4 image on a loop device. Both need the right
  to mount (root); :func:`SmallFs.mount` raises :class:`CannotMount` saying why not.
  ``umount()`` takes it away again (a lazy unmount if something still holds it).
"""

from __future__ import annotations

import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvbank.tiers.diskfile import frame_spans


class CannotMount(RuntimeError):
    """No small file system could be mounted here (not root, or no tmpfs/loop support)."""


@dataclass(frozen=True, slots=True)
class Rot:
    """What :func:`rot_values` damaged: the row names, and bytes flipped in all."""

    names: tuple[bytes, ...]
    flipped: int


def rot_values(data_dir: Path, fraction: float, seed: int) -> Rot:
    """Flip 1-4 bytes inside ``fraction`` (at least one) of the frames of a closed data dir."""
    spans = frame_spans(data_dir)
    rng = random.Random(seed)
    chosen = rng.sample(sorted(spans), max(1, round(len(spans) * fraction)))
    flipped = 0
    for name in chosen:
        span = spans[name]
        with open(span.path, "r+b") as f:
            for off in rng.sample(range(span.length), rng.randint(1, 4)):
                f.seek(span.offset + off)
                byte = f.read(1)[0]
                f.seek(span.offset + off)
                f.write(bytes([byte ^ rng.randint(1, 255)]))
                flipped += 1
    return Rot(tuple(chosen), flipped)


@dataclass
class SmallFs:
    """A mounted file system of ``size_mib`` MiB at ``path``."""

    path: Path
    kind: str  # "tmpfs" or "loop"
    image: Path | None = None

    @classmethod
    def mount(cls, path: Path, size_mib: int = 8) -> SmallFs:
        path.mkdir(parents=True, exist_ok=True)
        mount = shutil.which("mount")
        if mount is None:
            raise CannotMount("no mount binary on PATH")
        done = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return cls(path, "tmpfs")
        first = done.stderr.strip()
        image = path.with_name(path.name + ".img")
        mkfs = shutil.which("mkfs.ext4")
        if mkfs is None:
            raise CannotMount(f"tmpfs: {first}; no mkfs.ext4 for a loop-mounted image")
        with open(image, "wb") as f:
            f.truncate(size_mib << 20)
        made = subprocess.run([mkfs, "-q", "-F", str(image)], capture_output=True, text=True,
                              check=False)
        looped = made.returncode == 0 and subprocess.run(
            [mount, "-o", "loop", str(image), str(path)], capture_output=True, text=True,
            check=False).returncode == 0
        if not looped:
            image.unlink(missing_ok=True)
            raise CannotMount(f"tmpfs: {first}; loop-mounted ext4 image: failed too "
                              "(mounting needs root)")
        return cls(path, "loop", image)

    def umount(self) -> None:
        umount = shutil.which("umount") or "umount"
        done = subprocess.run([umount, str(self.path)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run([umount, "-l", str(self.path)], capture_output=True, check=False)
        if self.image is not None:
            self.image.unlink(missing_ok=True)
