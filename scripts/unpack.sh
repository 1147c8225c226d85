# unpack.sh is sourced by the scripts that run on the GPU host. unpack DIR turns each
# DIR/NAME.xz (or .gz) that scripts/build-gpu.sh compressed for the journey into
# DIR/NAME, once, executable; it returns non-zero, naming the file, if one cannot be
# unpacked.
unpack() {
	local z
	for z in "$1"/*.xz "$1"/*.gz; do
		[ -e "$z" ] || continue
		case $z in
		*.xz) unxz "$z" && chmod +x "${z%.xz}" ;;
		*.gz) gunzip -f "$z" && chmod +x "${z%.gz}" ;;
		esac || { echo "cannot unpack $z" >&2; return 2; }
	done
}

# unxz FILE.xz leaves FILE in its place, with xz, else with python3's lzma.
unxz() {
	if command -v xz >/dev/null; then
		xz -d -f "$1"
	else
		python3 -c 'import lzma, os, shutil, sys
src = sys.argv[1]
with lzma.open(src) as f, open(src[:-3], "wb") as out:
    shutil.copyfileobj(f, out)
os.remove(src)' "$1"
	fi
}
