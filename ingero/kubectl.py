"""Running kubectl: the Kubernetes API calls of the client commands (`ingero fleet`, `kubectl ingero`).

kubectl itself talks to the API server, so the user's kubeconfig, context,
namespace and every credential plugin work as they do for kubectl, with no
client code here. A kubectl that fails becomes one IngeroError line carrying
kubectl's own last line (``Error from server (NotFound): ...``).
"""

from __future__ import annotations

import json
import shutil
import subprocess

from ingero.errors import IngeroError


class Kubectl:
    def __init__(self, kubeconfig: str | None = None, context: str | None = None, namespace: str | None = None,
                 timeout_s: float = 60.0, missing_fix: str = "install kubectl (v1.26 or newer)"):
        self.base = ["kubectl"]
        if kubeconfig:
            self.base += ["--kubeconfig", kubeconfig]
        if context:
            self.base += ["--context", context]
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.missing_fix = missing_fix

    def argv(self, *args: str, namespaced: bool = False) -> list[str]:
        if shutil.which("kubectl") is None:
            raise IngeroError(f"kubectl is not installed (not on PATH): {self.missing_fix}")
        ns = ["--namespace", self.namespace] if namespaced and self.namespace else []
        return [*self.base, *ns, *args]

    def run(self, *args: str, input: str | None = None, namespaced: bool = False,
            binary: bool = False) -> subprocess.CompletedProcess:
        """kubectl `args`; the caller looks at the return code (see `error`)."""
        try:
            return subprocess.run(self.argv(*args, namespaced=namespaced), input=input, capture_output=True,
                                  text=not binary, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise IngeroError(f"kubectl {args[0]} took over {self.timeout_s:g} s; "
                              "check that the kubeconfig's cluster is reachable") from None

    def popen(self, *args: str, namespaced: bool = False, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args, namespaced=namespaced), **kw)

    @staticmethod
    def message(stderr: str | bytes) -> str:
        """kubectl's own account of a failure: its last non-empty line."""
        text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        msg = lines[-1] if lines else "no output"
        return msg[len("error: "):] if msg.startswith("error: ") else msg

    def raw(self, path: str, fix: str = "check --kubeconfig/--context") -> bytes:
        """GET an API path (no discovery needed, the kubeconfig's auth as is)."""
        proc = self.run("get", "--raw", path, binary=True)
        if proc.returncode != 0:
            raise IngeroError(f"kubectl get {path} failed: {self.message(proc.stderr)}; {fix}")
        return proc.stdout

    def get(self, path: str, fix: str = "check --kubeconfig/--context") -> dict:
        try:
            return json.loads(self.raw(path, fix))
        except ValueError:
            raise IngeroError(f"kubectl get {path} did not print JSON") from None
