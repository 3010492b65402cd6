# shellcheck shell=bash
# What every script in scripts/ shares; each sources it first:
#   . "$(dirname "$0")/lib.sh"
#
# - strict mode, and an ERR trap: no script dies silently; a command that fails
#   names the script, the line and itself on stderr;
# - say/die, with the script's name in front;
# - need PROGRAM:PACKAGE ... and need_packages PACKAGE ...: what a script calls
#   beyond Debian's required packages is declared at its top and installed from
#   Debian's packages when missing (as root; otherwise one line says what to install).
set -eEuo pipefail

SCRIPT=${0##*/}

say() { echo "$SCRIPT: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# Runs where errexit ends the script (not in a $(...) that bash runs without -e, whose
# status the command around it sees): the message set -e alone would not give.
on_error() { # status line command file
    [[ $- == *e* ]] || return 0
    local where="line $2"
    [[ ${4##*/} == "$SCRIPT" ]] || where="${4##*/} line $2"
    say "$where: \`$3\` failed with status $1"
    exit "$1"
}
trap 'on_error $? "$LINENO" "$BASH_COMMAND" "${BASH_SOURCE[0]:-}"' ERR

is_root() { [[ $(id -u) == 0 ]]; }

# The pids of live (not zombie) processes named $1 in this PID namespace (not the
# multi-node Slurm's nodes') whose command line has $2. Reads /proc itself: pgrep would
# also find the zombies that killed daemons leave here (PID 1 does not reap at once).
own_pid_ns=$(readlink /proc/$$/ns/pid)
pids_of() {
    local f line pid args
    for f in /proc/[0-9]*/stat; do
        read -r line 2>/dev/null <"$f" || continue
        [[ $line == *" ($1) "[!Z]* ]] || continue # "PID (COMM) STATE ..."
        pid=${f#/proc/}
        pid=${pid%/stat}
        [[ $(readlink "/proc/$pid/ns/pid" 2>/dev/null) == "$own_pid_ns" ]] || continue
        args=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || continue
        [[ $args == *"${2:-}"* ]] && echo "$pid"
    done
    return 0
}

# Install Debian packages (no recommends with --no-recommends first). Another apt may
# be running (CI beside a developer): install waits for the dpkg lock; update gives up
# at once on the lists lock, so it is tried again.
apt_install() {
    local opts=(-o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    if [[ ${1:-} == --no-recommends ]]; then
        opts+=(--no-install-recommends)
        shift
    fi
    is_root || die "needs Debian's $* installed: run as root, or first: sudo apt-get install $*"
    say "installing $*"
    export DEBIAN_FRONTEND=noninteractive
    local log try
    log=$(mktemp)
    for try in $(seq 1 60); do
        if apt-get "${opts[@]}" -q update >"$log" 2>&1; then break; fi
        if ! grep -q 'Could not get lock' "$log" || ((try == 60)); then
            cat "$log" >&2
            rm -f "$log"
            die "apt-get update failed"
        fi
        sleep 10
    done
    if ! apt-get "${opts[@]}" -q -y install "$@" >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        rm -f "$log"
        die "apt-get install $* failed"
    fi
    rm -f "$log"
}

# The packages, of those named, that are not installed.
missing_packages() {
    local p
    for p in "$@"; do
        [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true) == "install ok installed" ]] || echo "$p"
    done
}

# need_packages [--no-recommends] PACKAGE...: install those not installed.
need_packages() {
    local flag=() missing
    if [[ ${1:-} == --no-recommends ]]; then
        flag=(--no-recommends)
        shift
    fi
    mapfile -t missing < <(missing_packages "$@")
    ((${#missing[@]} == 0)) || apt_install "${flag[@]}" "${missing[@]}"
}

# need [--no-recommends] PROGRAM:PACKAGE...: install the package of each program not found
# (a PROGRAM with a slash is a path to test, not a name to look up).
need() {
    local flag=() pair program missing=()
    if [[ ${1:-} == --no-recommends ]]; then
        flag=(--no-recommends)
        shift
    fi
    for pair in "$@"; do
        program=${pair%%:*}
        if [[ $program == */* ]]; then
            [[ -x $program ]] || missing+=("${pair#*:}")
        else
            command -v "$program" >/dev/null 2>&1 || missing+=("${pair#*:}")
        fi
    done
    ((${#missing[@]} == 0)) || apt_install "${flag[@]}" "${missing[@]}"
}
