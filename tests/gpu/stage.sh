#!/usr/bin/env bash
# Prepare wheels for the GPU machine (Python 3.12, x86_64, no registry access) in parts of at most 60 MiB.
# usage: tests/gpu/stage.sh OUTDIR REQ.txt [REQ.txt...]
#   downloads every pinned wheel of the lists (no dependencies resolved: the lists are complete),
#   cuts them into OUTDIR/part01, part02, ... (large wheels are split into pieces), and writes
#   OUTDIR/install.sh, which runs ON THE GPU MACHINE after all parts were copied to $HOME/stage.
# OUTDIR must be git-ignored in your checkout (e.g. .whl/gpu): then each part travels with `carry`.
set -euo pipefail
out=$1; shift
all="$out/all"; mkdir -p "$all"
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_39_x86_64)
wanted=()
for req in "$@"; do
  while read -r spec; do
    name=$(echo "${spec%%==*}" | tr '-' '_'); ver=${spec##*==}
    found=$(ls "$all"/"$name"-"$ver"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$found" ]; then
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d "$all" "$spec" 2>&1 | grep -v 'is ignored' || true
      found=$(ls "$all"/"$name"-"$ver"-*.whl 2>/dev/null | head -1 || true)
    fi
    [ -n "$found" ] || { echo "no wheel for $spec" >&2; exit 1; }
    wanted+=("$found")
  done < <(grep -vE '^\s*(#|$)' "$req")
done
rm -rf "$out"/part*; limit=$((60 * 1024 * 1024)); n=1; used=0
part() { printf '%s/part%02d' "$out" "$n"; }
mkdir -p "$(part)"
add() { # file size
  if (( used + $2 > limit )); then n=$((n + 1)); used=0; mkdir -p "$(part)"; fi
  ln -f "$1" "$(part)/" 2>/dev/null || cp "$1" "$(part)/"; used=$((used + $2))
}
pieces="$out/pieces"; rm -rf "$pieces"; mkdir -p "$pieces"
for w in $(ls -S "${wanted[@]}"); do
  size=$(stat -c %s "$w")
  if (( size > limit )); then
    split -b 60M -d -a 2 "$w" "$pieces/$(basename "$w").piece-"
    for p in "$pieces/$(basename "$w")".piece-*; do add "$p" "$(stat -c %s "$p")"; done
  else add "$w" "$size"; fi
done
{
  echo '#!/bin/bash'
  echo '# Run on the GPU machine once $HOME/stage holds every part: reassemble split wheels, then install them all.'
  echo 'set -e; mkdir -p $HOME/wheels; cp $HOME/stage/part*/*.whl $HOME/wheels/ 2>/dev/null || true'
  for w in "${wanted[@]}"; do
    b=$(basename "$w")
    if [ -e "$pieces/$b.piece-00" ]; then
      echo "cat \$HOME/stage/part*/$b.piece-* > \$HOME/wheels/$b"
      echo "echo \"$(sha256sum "$w" | cut -d' ' -f1)  \$HOME/wheels/$b\" | sha256sum -c --quiet -"
    fi
  done
  echo 'PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --no-deps --no-compile $HOME/wheels/*.whl'
} > "$out/install.sh"
cp "$out/install.sh" "$(part)/"
echo "parts:"; for d in "$out"/part*; do printf '  %s  %s\n' "$d" "$(du -sh "$d" | cut -f1)"; done
echo "Then, one call per part, back to back (the machine stays warm only 30 s between calls):"
echo '  carry ["<part dir>"], command: mkdir -p $HOME/stage && cp -r <part dir> $HOME/stage/'
echo 'and in the next call: bash $HOME/stage/part*/install.sh'
