"""nsqd 1.3.0, the reference beside FDQ's broker in ``bench/broker.py``: found or built
from source on first use, started on loopback with a fresh data directory.

Nothing of it is committed: the sources and the binary live in a cache outside the
repository (``~/.cache/fdq-bench/nsqd``, or ``$XDG_CACHE_HOME/fdq-bench/nsqd``).

Where the binary comes from, first match wins:

1. ``--nsqd PATH`` (bench/broker.py) or ``FDQ_BENCH_NSQD``;
2. the cache's ``bin/nsqd``;
3. ``nsqd`` on ``PATH``;
4. a build into the cache (about 5 s, offline) when everything it needs is here.

The build (GOPATH mode, Debian's Go 1.19 and its packaged libraries, no module proxy):

* ``apt-get install golang-go golang-github-blang-semver-dev
  golang-github-julienschmidt-httprouter-dev golang-github-burntsushi-toml-dev
  golang-github-golang-snappy-dev`` (the four libraries land in /usr/share/gocode, at
  versions nsqd 1.3.0 builds with);
* the six source repositories of ``SOURCES`` as bare git repositories
  ``<owner>+<name>/repo`` under ``FDQ_BENCH_MIRRORS`` (default /work/.mirror, where this
  project's sessions keep fetched repositories), or cloned there from
  ``FDQ_BENCH_GIT_BASE`` (e.g. ``https://github.com``) when set;
* each pinned commit is checked by its full hash and unpacked with ``git archive`` at its
  import path under the cache's GOPATH. One layout matters: judwhite/go-svc goes to
  ``src/github.com/judwhite/go-svc``, the path ``apps/nsqd`` imports. nsqd's go.mod
  ``replace``s it by mreiferson/go-svc, but GOPATH mode ignores go.mod, so unpacked under
  the mreiferson name the build fails with ``cannot find package
  "github.com/judwhite/go-svc"``;
* ``GO111MODULE=off GOPROXY=off GOPATH=<cache>/gopath:/usr/share/gocode go build
  ./apps/nsqd``, then ``nsqd --version`` must say v1.3.

Where something is missing, ``find`` returns no path and the reason, naming it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

from bench._common import free_port, stop_process

# (owner/name, commit, import path): nsqd v1.3.0 and what it needs beyond Debian's packages.
SOURCES = (
    ("nsqio/nsq", "f580340fd5be61a94d0fef388458f027925c7fc0", "github.com/nsqio/nsq"),  # v1.3.0
    ("nsqio/go-nsq", "259dc590b2e791e4b11ad7496bc312ec81d1004b", "github.com/nsqio/go-nsq"),  # v1.1.0
    ("nsqio/go-diskqueue", "02dd623fa43cc75fc60680dc91ed2591aa79023c", "github.com/nsqio/go-diskqueue"),  # v1.1.0
    ("mreiferson/go-options", "6fa6a130bc8c7e1dc5c79adf48dfcdb1b55fe3ab", "github.com/mreiferson/go-options"),
    ("bmizerany/perks", "d9a9656a3a4b1c2864fdb44db2ef8619772d92aa", "github.com/bmizerany/perks"),
    # nsqd imports github.com/judwhite/go-svc; go.mod's replace (mreiferson/go-svc) is not
    # read in GOPATH mode: unpack this commit under the imported path
    ("judwhite/go-svc", "7a96e00010f68d9436e3de53a70c53f209a0c244", "github.com/judwhite/go-svc"),
)
GOCODE = "/usr/share/gocode"
DEBIAN_LIBS = {  # import path under GOCODE/src -> Debian package
    "github.com/blang/semver": "golang-github-blang-semver-dev",
    "github.com/julienschmidt/httprouter": "golang-github-julienschmidt-httprouter-dev",
    "github.com/BurntSushi/toml": "golang-github-burntsushi-toml-dev",
    "github.com/golang/snappy": "golang-github-golang-snappy-dev",
}
BUILD_LIMIT_S = 300


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fdq-bench", "nsqd")


def mirrors_dir() -> str:
    return os.environ.get("FDQ_BENCH_MIRRORS", "/work/.mirror")


def version(path: str) -> str:
    """``nsqd --version``'s line, e.g. 'nsqd v1.3.0 (built w/go1.19.8)'."""
    return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()


def find(path: str | None = None, build: bool = True) -> tuple[str | None, str]:
    """(the nsqd binary, its version line) or (None, why there is none)."""
    given = path or os.environ.get("FDQ_BENCH_NSQD")
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            return None, f"no executable nsqd at {given} (--nsqd / FDQ_BENCH_NSQD)"
        return _checked(given)
    cached = os.path.join(cache_dir(), "bin", "nsqd")
    if os.access(cached, os.X_OK):
        return _checked(cached)
    on_path = shutil.which("nsqd")
    if on_path:
        return _checked(on_path)
    if not build:
        return None, f"no nsqd at {cached} nor on PATH (building it was not asked for)"
    why = missing_for_build()
    if why:
        return None, f"no nsqd at {cached} nor on PATH, and it cannot be built here: {why}"
    try:
        built = build_into(cache_dir())
    except (subprocess.SubprocessError, OSError, RuntimeError) as e:
        return None, f"building nsqd into {cache_dir()} failed: {e}"
    return _checked(built)


def _checked(path: str) -> tuple[str | None, str]:
    try:
        v = version(path)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{path} does not run: {e}"
    if " v1.3." not in f" {v}":
        return None, f"{path} is not nsqd 1.3 ({v!r})"
    return path, v


def missing_for_build() -> str:
    """'' when nsqd can be built here, else what is missing (and how to get it)."""
    if not shutil.which("go"):
        return "no `go` on PATH (apt-get install golang-go " + " ".join(DEBIAN_LIBS.values()) + ")"
    libs = [pkg for ipath, pkg in DEBIAN_LIBS.items() if not os.path.isdir(os.path.join(GOCODE, "src", ipath))]
    if libs:
        return f"Go libraries missing from {GOCODE} (apt-get install {' '.join(libs)})"
    if not shutil.which("git"):
        return "no `git` on PATH"
    if os.environ.get("FDQ_BENCH_GIT_BASE"):
        return ""
    absent = [repo for repo, _, _ in SOURCES if not os.path.isdir(_gitdir(repo))]
    if absent:
        return (f"source mirrors missing under {mirrors_dir()}: {', '.join(absent)} (bare git repositories "
                f"<owner>+<name>/repo; set FDQ_BENCH_MIRRORS, or FDQ_BENCH_GIT_BASE=https://github.com to clone them)")
    return ""


def _gitdir(repo: str) -> str:
    return os.path.join(mirrors_dir(), repo.replace("/", "+"), "repo")


def build_into(root: str) -> str:
    """Build nsqd 1.3.0 into ``root``/bin/nsqd (sources under ``root``/gopath); return its path."""
    existing = root
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if subprocess.run(["git", "-C", existing, "rev-parse", "--is-inside-work-tree"],
                      capture_output=True).returncode == 0:
        raise RuntimeError(f"{root} is inside a git work tree: the nsqd sources and binary are never committed")
    gopath = os.path.join(root, "gopath")
    t0 = time.monotonic()
    for repo, rev, ipath in SOURCES:
        gitdir = _gitdir(repo)
        if not os.path.isdir(gitdir):
            base = os.environ["FDQ_BENCH_GIT_BASE"].rstrip("/")
            os.makedirs(os.path.dirname(gitdir), exist_ok=True)
            _run(["git", "clone", "--bare", "-q", f"{base}/{repo}", gitdir])
        got = _run(["git", "--git-dir", gitdir, "rev-parse", "--verify", f"{rev}^{{commit}}"]).strip()
        if got != rev:
            raise RuntimeError(f"{repo}: {rev} resolves to {got}")
        dest = os.path.join(gopath, "src", ipath)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        archive = subprocess.Popen(["git", "--git-dir", gitdir, "archive", rev], stdout=subprocess.PIPE)
        _run(["tar", "-x", "-C", dest], stdin=archive.stdout)
        if archive.wait(60) != 0:
            raise RuntimeError(f"git archive of {repo}@{rev} failed")
    os.makedirs(os.path.join(root, "bin"), exist_ok=True)
    out = os.path.join(root, "bin", "nsqd")
    env = {**os.environ, "GO111MODULE": "off", "GOPROXY": "off", "GOFLAGS": "",
           "GOPATH": f"{gopath}:{GOCODE}"}
    _run(["go", "build", "-o", out + ".part", "./apps/nsqd"], cwd=os.path.join(gopath, "src", "github.com/nsqio/nsq"),
         env=env)
    os.replace(out + ".part", out)
    print(f"  built {version(out)} into {out} in {time.monotonic() - t0:.1f} s", flush=True)
    return out


def _run(cmd, **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_LIMIT_S, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(r.stderr or r.stdout).strip()[-500:]}")
    return r.stdout


class Nsqd:
    """nsqd on loopback (TCP and HTTP on free ports) with a fresh ``--data-path`` in
    ``tmp``, every message through its disk queue (``--mem-queue-size=0``, the closest to
    FDQ's durability); ``port``, ``pid``, ``stop()`` by PID."""

    name = "nsqd"

    def __init__(self, binary: str, tmp: str, start_limit_s: float = 15.0):
        self.port, http = free_port(), free_port()
        data = os.path.join(tmp, "nsqd-data")
        os.makedirs(data)
        self.log = open(os.path.join(tmp, "nsqd.log"), "w+")
        self.proc = subprocess.Popen([binary, "--data-path", data, "--tcp-address", f"127.0.0.1:{self.port}",
                                      "--http-address", f"127.0.0.1:{http}", "--mem-queue-size=0",
                                      "--log-level", "warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        deadline = time.monotonic() + start_limit_s
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{http}/ping", timeout=1).read() == b"OK":
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                raise RuntimeError(f"nsqd did not start: {self.log.read()[-500:]!r}")
            time.sleep(0.05)

    def stop(self):
        stop_process(self.proc, 15)
        self.log.close()


if __name__ == "__main__":
    # python -m bench.nsqd: find or build it, say which
    where, what = find()
    print(f"{where}: {what}" if where else f"no nsqd: {what}")
    raise SystemExit(0 if where else 1)
