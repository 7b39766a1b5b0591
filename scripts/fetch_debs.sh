#!/usr/bin/env bash
# Downloads the header-only/static build dependencies as .deb files into .debs/ (git-ignored),
# to carry to a machine without network (the GPU machine): `make deps` unpacks them there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
apt-get download nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev
