# Sourced by the test scripts that run under another Python: `venv_python
# VERSION VENV` finds Python VERSION (pyenv's, else pythonVERSION on the
# PATH), keeps a healthy venv at VENV or makes one, and prints its python.
venv_python() {
    local version=$1 venv=$2 base
    base="$(ls -d /root/.pyenv/versions/"$version".*/bin/python 2>/dev/null | tail -n 1)"
    if [[ -z "$base" ]]; then
        base="$(command -v "python$version" || true)"
    fi
    if [[ -z "$base" ]] || ! "$base" --version >/dev/null 2>&1; then
        echo "no Python $version found (neither pyenv's nor python$version)" >&2
        return 1
    fi
    if [[ -e "$venv" ]] && ! { "$venv/bin/python" -c \
        "import sys; assert sys.version.startswith('$version.')" &&
        "$venv/bin/python" -m pip --version; } >/dev/null 2>&1; then
        if [[ -f "$venv/pyvenv.cfg" ]]; then
            echo "$venv is broken; recreating it" >&2
            rm -rf "$venv"
        else
            echo "$venv exists and is not a venv; remove it" >&2
            return 1
        fi
    fi
    if [[ ! -e "$venv" ]]; then
        mkdir -p "$(dirname "$venv")"
        "$base" -m venv "$venv" >&2
    fi
    echo "$venv/bin/python"
}
