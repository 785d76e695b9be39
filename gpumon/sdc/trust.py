"""Whose bundle is it: a replay runs what a bundle names with the privileges of whoever replays it.

A capture bundle names code to import (``model_factory``, ``loss_fn``, ``optimizer``: a module name,
else a file) and every bundle holds files for ``torch.load``. Jobs write bundles under the guard's
spool, which every local user can write to, and root replays them: replayed as they are, any local
user's code would run as root. ``check_bundle`` passes a bundle only if root or the replaying user
(the effective uid) alone could have written all that the replay reads or imports, and could alone
change it afterwards:

- the bundle folder and everything under it: owned by one of them, not writable by group or others,
  folders and regular files only; a symlink only to a path inside the bundle;
- every folder on the way to it and every symlink followed there: owned by one of them; a folder
  writable by others only with the sticky bit (others may add names there, not rename ours);
- the captured step a failure bundle replays (``source.capture``): the same, as a bundle of its own;
- the code a capture bundle names: the file its module name resolves to along ``sys.path`` (and each
  package ``__init__`` on the way), else the ``file`` it names, as a regular file in a folder no one
  else can write (a ``__pycache__/*.pyc`` planted there is loaded instead of the source), its
  ``__pycache__`` alike; and every ``sys.path`` folder searched before the module was found (one
  planted in an earlier folder would be imported instead), all of them when it was not found.

Check, then use: once the check passes, nobody but root and the replaying user can change what it
looked at, so what they replay is what was checked. The manifest is read once, through a
descriptor of the checked folder (``O_NOFOLLOW``), and the code imported is the code the check
resolved (``Checked.code``). What it does not cover: what the named code imports in turn (that code
was written by a trusted user; its own imports follow ``sys.path`` like any import of this process),
a package ``__init__`` that changes its own ``__path__``, and changes by root or the replaying user
between the check and the replay.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import os
import pwd
import stat
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

MANIFEST = "manifest.json"
# the manifest keys whose code a capture bundle's replay imports (gpumon.sdc.bundle.resolve_ref)
CODE_REFS = ("model_factory", "loss_fn", "optimizer")
_MAX_SYMLINKS = 40  # as the kernel's ELOOP


class BundleError(Exception):
    """A bundle that cannot be written, read or run; says which and why."""


class UntrustedBundle(BundleError):
    """A bundle someone other than root and the replaying user could have written or could change.

    ``path``: what the check stopped at; ``owner``: the bundle folder's owner (whom ``--as-owner``
    replays as); ``uids``: the owners the check accepted."""

    def __init__(self, bundle: Path, path: Path, why: str, *, owner: int | None,
                 uids: Collection[int]) -> None:
        self.bundle = bundle
        self.path = path
        self.why = why
        self.owner = owner
        self.uids = frozenset(uids)
        super().__init__(f"refusing bundle {bundle}: {why}")


def describe_uid(uid: int) -> str:
    """``uid 65534 (nobody)``."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid} (no such user)"


def trusted_uids() -> frozenset[int]:
    """Who may have written a bundle this process replays: root and the effective user."""
    return frozenset({0, os.geteuid()})


def bundle_folder(path: Path) -> Path:
    """The bundle's folder: ``path``, or the folder of the manifest ``path`` names."""
    return path if path.is_dir() else path.parent


def bundle_owner(path: Path) -> int:
    """The uid that owns the bundle's folder (whom ``--as-owner`` replays as)."""
    try:
        return os.stat(bundle_folder(path)).st_uid
    except OSError as exc:
        raise BundleError(f"{path}: not a readable bundle: {exc.strerror or exc}") from None


@dataclass
class Checked:
    """A bundle that passed: its resolved path (as given: folder or manifest), its folder, its
    manifest as read through the checked folder, and the code file each ``CODE_REFS`` key is to be
    imported from (absent: by its module name, found in a checked place)."""

    path: Path
    folder: Path
    manifest: dict[str, Any]
    code: dict[str, Path] = field(default_factory=dict)


def check_bundle(path: Path, uids: Collection[int] | None = None) -> Checked:
    """Refuse (``UntrustedBundle``) a bundle that anyone but ``uids`` (default: root and the
    effective user) could have written or could change; see the module's words for what is
    looked at. ``BundleError`` for a bundle that cannot be read at all."""
    allowed = trusted_uids() if uids is None else frozenset(uids)
    owner: int | None
    try:
        owner = bundle_owner(path)
    except BundleError:
        owner = None
    return _Check(path, allowed, owner).bundle(path, set())


class _Check:
    def __init__(self, bundle: Path, uids: frozenset[int], owner: int | None) -> None:
        self.label = bundle
        self.uids = uids
        self.owner = owner
        self.passed: set[Path] = set()  # folders on the way already checked

    # -- words ---------------------------------------------------------------------------------

    def refuse(self, path: Path, why: str) -> NoReturn:
        raise UntrustedBundle(self.label, path, why, owner=self.owner, uids=self.uids)

    def trusted(self) -> str:
        return " or ".join(["root", *(f"you ({describe_uid(u)})" for u in sorted(self.uids) if u != 0)])

    def owned(self, path: Path, st: os.stat_result, what: str, note: str = "") -> None:
        if st.st_uid not in self.uids:
            self.refuse(path, f"{what} {path}{note} is owned by {describe_uid(st.st_uid)}, not by "
                              f"{self.trusted()}")

    def unwritable(self, path: Path, st: os.stat_result, what: str, note: str = "", *,
                   sticky_ok: bool = False, risk: str = "") -> None:
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and not (sticky_ok and st.st_mode & stat.S_ISVTX):
            by = "others" if st.st_mode & stat.S_IWOTH else "its group"
            mode = stat.S_IMODE(st.st_mode)
            self.refuse(path, f"{what} {path}{note} is writable by {by} (mode {mode:04o}): "
                              + (risk or "they could change it between this check and the replay"))

    def lstat(self, path: Path) -> os.stat_result:
        try:
            return os.lstat(path)
        except OSError as exc:
            raise BundleError(f"{self.label}: cannot check {path}: {exc.strerror or exc}") from None

    # -- paths -------------------------------------------------------------------------------------

    def on_the_way(self, folder: Path, to: str | Path) -> None:
        """A folder a path goes through: whoever can rename its entries can swap what is below."""
        if folder in self.passed:
            return
        st = self.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            raise BundleError(f"{self.label}: {folder} is not a folder")
        self.owned(folder, st, "the folder", f", on the way to {to},")
        self.unwritable(folder, st, "the folder", f", on the way to {to},", sticky_ok=True)
        self.passed.add(folder)

    def resolve(self, path: str | Path) -> Path:
        """``path`` resolved as the kernel resolves it, every folder it goes through and every
        symlink it follows checked on the way (``os.path.realpath`` alone would check where a
        symlink points now, not who can point it elsewhere before the replay opens it)."""
        todo = list(reversed(Path(os.getcwd(), path).parts[1:]))
        current = Path("/")
        hops = 0
        while todo:
            self.on_the_way(current, path)
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                current = current.parent
                continue
            nxt = current / name
            st = self.lstat(nxt)
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_SYMLINKS:
                    raise BundleError(f"{self.label}: too many symlinks in {path}")
                self.owned(nxt, st, "the symlink", f", on the way to {path},")
                target = Path(os.readlink(nxt))
                if target.is_absolute():
                    current = Path("/")
                todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
                continue
            current = nxt
        return current

    def strict_folder(self, folder: Path, what: str, note: str = "", risk: str = "") -> os.stat_result:
        """A folder whose entries are read or imported: nobody else may add one (sticky or not)."""
        st = self.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            raise BundleError(f"{self.label}: {what} {folder}{note} is not a folder")
        self.owned(folder, st, what, note)
        self.unwritable(folder, st, what, note, risk=risk)
        return st

    def plain_file(self, file: Path, st: os.stat_result, what: str, note: str = "") -> None:
        if not stat.S_ISREG(st.st_mode):
            self.refuse(file, f"{what} {file}{note} is not a regular file")
        self.owned(file, st, what, note)
        self.unwritable(file, st, what, note)

    # -- the bundle --------------------------------------------------------------------------------

    def bundle(self, path: Path, seen: set[Path]) -> Checked:
        real = self.resolve(path)
        st = self.lstat(real)
        folder, name = (real, MANIFEST) if stat.S_ISDIR(st.st_mode) else (real.parent, real.name)
        if folder in seen:  # a failure bundle naming itself, or two naming each other
            raise BundleError(f"{self.label}: {folder} is its own captured step")
        seen.add(folder)
        top = self.strict_folder(folder, "the bundle folder")
        self.contents(folder)
        manifest = self.manifest(folder, top, name)
        checked = Checked(real, folder, manifest)
        kind = manifest.get("kind")
        if kind == "capture":
            self.inside(folder, folder / str(manifest.get("state_file") or "state.pt"))
            for key in CODE_REFS:
                file = self.code(key, manifest.get(key))
                if file is not None:
                    checked.code[key] = file
        elif kind == "failure":
            files = manifest.get("files")
            for file in files.values() if isinstance(files, dict) else ():
                if file:
                    self.inside(folder, folder / str(file))
            source = manifest.get("source") or {}
            if isinstance(source, dict) and source.get("capture"):
                self.bundle(Path(str(source["capture"])), seen)
        return checked

    def contents(self, folder: Path) -> None:
        def unreadable(exc: OSError) -> None:
            raise BundleError(f"{self.label}: cannot read {exc.filename}: {exc.strerror or exc}")

        for root, dirs, files in os.walk(folder, onerror=unreadable):
            for name in [*dirs, *files]:
                entry = Path(root, name)
                st = self.lstat(entry)
                if stat.S_ISLNK(st.st_mode):
                    self.owned(entry, st, "the symlink")
                    self.inside(folder, entry)
                elif stat.S_ISDIR(st.st_mode):
                    self.strict_folder(entry, "the folder")
                else:
                    self.plain_file(entry, st, "the file")

    def inside(self, folder: Path, path: Path) -> None:
        """A path the replay opens must stay in the bundle, whatever symlinks it goes through."""
        try:
            target = self.resolve(path)
        except UntrustedBundle:
            raise
        except BundleError:  # absent: nothing to read there, but where would it be?
            target = Path(os.path.realpath(path))
        if target != folder and folder not in target.parents:
            self.refuse(path, f"{path} leads out of the bundle, to {target}")

    def manifest(self, folder: Path, top: os.stat_result, name: str) -> dict[str, Any]:
        """Read through the folder checked above: the manifest whose code refs are checked is the
        one the replay gets (``Checked.manifest``)."""
        file = folder / name
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            dfd = os.open(folder, flags | os.O_DIRECTORY)
        except OSError as exc:
            raise BundleError(f"{self.label}: cannot open {folder}: {exc.strerror or exc}") from None
        try:
            st = os.fstat(dfd)
            if (st.st_dev, st.st_ino) != (top.st_dev, top.st_ino):
                self.refuse(folder, f"the bundle folder {folder} was replaced while it was checked")
            try:
                # O_NONBLOCK: a FIFO put there must not hang the check (it is refused below)
                fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dfd)
            except OSError as exc:
                raise BundleError(f"{file}: not a readable bundle manifest: {exc.strerror or exc}") from None
            with os.fdopen(fd, "rb") as fh:
                self.plain_file(file, os.fstat(fh.fileno()), "the manifest")
                raw = fh.read()
        finally:
            os.close(dfd)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"{file}: not a readable bundle manifest: {exc}") from None
        if not isinstance(data, dict):
            raise BundleError(f"{file}: not a gpumon replay bundle")
        return data

    # -- code ------------------------------------------------------------------------------------

    def code(self, key: str, ref: Any) -> Path | None:
        """Check the code ``ref`` names as ``resolve_ref`` finds it: its module, else its file.
        Returns the resolved file when the file is what will be imported."""
        if not isinstance(ref, Mapping):
            return None
        module, file = ref.get("module"), ref.get("file")
        if isinstance(module, str) and module and self.module(key, module):
            return None
        if not isinstance(file, str) or not file:
            return None  # nothing to import: the replay says it cannot find the code
        real = self.resolve(file)
        self.code_file(real, f"{key}'s code")
        return real

    def code_file(self, file: Path, desc: str) -> None:
        self.plain_file(file, self.lstat(file), "the file", f", {desc},")
        self.strict_folder(file.parent, "the folder", f", holding {desc},")
        cache = file.parent / "__pycache__"
        with contextlib.suppress(FileNotFoundError):
            os.lstat(cache)
            # the import loads a .pyc from here instead of the source when its header matches
            self.strict_folder(cache, "the folder", f", holding compiled copies of {desc},")
            stem = file.name.rpartition(".")[0] or file.name
            for entry in sorted(cache.iterdir()):
                if entry.name.startswith(stem + "."):
                    self.plain_file(entry, self.lstat(entry), "the file", f", a compiled copy of {desc},")

    def module(self, key: str, name: str) -> bool:
        """Check where ``import name`` finds its code, without importing anything (a dotted
        name's packages are looked up, not run). False: not found, the file is what is used."""
        top, *rest = name.split(".")
        if top in sys.builtin_module_names or importlib.machinery.FrozenImporter.find_spec(top):
            return True
        spec = None
        for entry in sys.path:
            spec = self.search(key, name, entry or ".", top)
            if spec is not None:
                break
        if spec is None:
            spec = self.other_finders(top)
        if spec is None:
            return False
        full = top
        for part in [None, *rest]:
            if part is not None:
                locations = spec.submodule_search_locations
                if not locations:
                    return False
                full = f"{full}.{part}"
                spec = importlib.machinery.PathFinder.find_spec(full, list(locations))
                if spec is None:
                    return False
            self.spec(key, spec)
        return True

    @staticmethod
    def other_finders(top: str) -> Any:
        """The finders the import system asks after ``sys.path``'s (an editable install's maps
        names to folders of its own, checked like any). Not ``importlib.util.find_spec``: it answers
        from this process's ``sys.modules``, which is not the worker's."""
        skip = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter,
                importlib.machinery.PathFinder)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder in skip or find is None:
                continue
            spec = find(top, None)
            if spec is not None:
                return spec
        return None

    def search(self, key: str, name: str, entry: str, top: str) -> Any:
        """One ``sys.path`` folder the import of ``name`` searches: refused if another user could
        put a module there; the module's spec if it is there."""
        try:
            real = self.resolve(entry)
        except UntrustedBundle:
            raise
        except BundleError:
            return None  # absent: the import system skips it too
        st = self.lstat(real)
        note = f", on sys.path (searched for {key}'s module {name}),"
        if stat.S_ISDIR(st.st_mode):
            self.strict_folder(real, "the folder", note, risk=f"a module {top} put there would be imported "
                               "instead (is it the current folder of `python -m gpumon`?)")
        else:
            self.plain_file(real, st, "the file", note)  # a zip archive
        return importlib.machinery.PathFinder.find_spec(top, [entry or "."])

    def spec(self, key: str, spec: Any) -> None:
        origin = spec.origin if spec.has_location else None
        if origin:
            self.code_file(self.resolve(origin), f"{key}'s module {spec.name}")
        for location in spec.submodule_search_locations or ():
            self.strict_folder(self.resolve(location), "the folder",
                               f", the package {spec.name} of {key}'s code,")


def checked_paths(bundles: Iterable[Path], *, trust: bool) -> list[Path]:
    """The bundles to run: as given with ``trust``, else checked and resolved (``check_bundle``)."""
    return [Path(b) if trust else check_bundle(Path(b)).path for b in bundles]
