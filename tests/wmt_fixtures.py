"""Small WMT look-alikes for the data-pipeline tests: archives with the real member names, SGML test sets in the
layout sacreBLEU expects, and an HTTP server on 127.0.0.1 that can cut a connection mid-file and honours ranges."""
from __future__ import annotations

import gzip
import hashlib
import io
import random
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# A tiny bilingual lexicon: sentences are built word by word, so both sides are real-looking and aligned.
NOUNS = [("house", "Haus"), ("street", "Straße"), ("city", "Stadt"), ("child", "Kind"), ("book", "Buch"),
         ("tree", "Baum"), ("car", "Auto"), ("door", "Tür"), ("garden", "Garten"), ("school", "Schule")]
ADJECTIVES = [("big", "groß"), ("small", "klein"), ("old", "alt"), ("new", "neu"), ("green", "grün"),
              ("beautiful", "schön"), ("quiet", "ruhig"), ("well-known", "bekannte")]
NAMES = ["Anna", "Jürgen", "Zoë", "Max", "Lea", "Müller"]


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    n_en, n_de = rng.choice(NOUNS)
    a_en, a_de = rng.choice(ADJECTIVES)
    name = rng.choice(NAMES)
    form = rng.randrange(3)
    if form == 0:
        return f"The {n_en} of {name} is {a_en}.", f"Das {n_de} von {name} ist {a_de}."
    if form == 1:
        return f"\u201cIs the {n_en} {a_en}?\u201d, asked {name}.", f"\u201eIst das {n_de} {a_de}?\u201c, fragte {name}."
    return f"{name} sees a {a_en} {n_en} - and it's {rng.randint(2, 99)} years old!", \
        f"{name} sieht ein {a_de}es {n_de} - und es ist {rng.randint(2, 99)} Jahre alt!"


def corpus(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [sentence_pair(rng) for _ in range(n)]


def text(lines) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)  # the same bytes every time: a stable checksum


def sgml(lines: list[str], set_id: str, lang: str) -> bytes:
    segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, start=1))
    return (f'<srcset setid="{set_id}" srclang="any">\n<doc sysid="ref" docid="fixture" genre="news" origlang="en">\n'
            f"{segs}</doc>\n</srcset>\n").encode("utf-8")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The training corpora of configs/data/wmt14_en_de.yaml, small, with the real archive and member names.
# Pair 0 of europarl is too long after BPE (> max_len) and pair 1 breaks the 1.5 length ratio: cleaning drops them.
LONG = ("word " * 300).strip()


def wmt14_en_de_archives(n_pairs: int = 700) -> dict[str, bytes]:
    europarl = [(LONG, LONG), ("A short one .", "Dies ist ein sehr viel viel längerer Satz mit vielen Wörtern .")]
    europarl += corpus(n_pairs - 2, seed=1)
    crawl, news = corpus(n_pairs // 2, seed=2), corpus(n_pairs // 4, seed=3)
    return {
        "training-parallel-europarl-v7.tgz": tgz({
            "training/europarl-v7.de-en.en": text(s for s, _ in europarl),
            "training/europarl-v7.de-en.de": text(t for _, t in europarl),
            "training/europarl-v7.fr-en.en": text(["unused"])}),
        "training-parallel-commoncrawl.tgz": tgz({
            "commoncrawl.de-en.en": text(s for s, _ in crawl),
            "commoncrawl.de-en.de": text(t for _, t in crawl)}),
        "training-parallel-nc-v9.tgz": tgz({
            "training/news-commentary-v9.de-en.en": text(s for s, _ in news),
            "training/news-commentary-v9.de-en.de": text(t for _, t in news)}),
    }


TEST_PAIRS = corpus(40, seed=4)


def wmt14_test_archive() -> bytes:
    """sacreBLEU's wmt14/full archive for en-de, as its DATASETS entry names the members."""
    return tgz({"test-full/newstest2014-deen-src.en.sgm": sgml([s for s, _ in TEST_PAIRS], "newstest2014", "en"),
                "test-full/newstest2014-deen-ref.de.sgm": sgml([t for _, t in TEST_PAIRS], "newstest2014", "de")})


def seed_sacrebleu(cache: Path) -> None:
    """Pre-seed sacreBLEU's cache ($SACREBLEU) with the fixture test set, where sacreBLEU keeps its download."""
    raw = cache / "wmt14" / "full" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "wmt14_full.test-full.tgz").write_bytes(wmt14_test_archive())


def source_overrides(base_url: str, archives: dict[str, bytes], data: str = "wmt14_en_de") -> list[str]:
    """Command-line overrides pointing the preset's sources at the local server, with the fixtures' checksums."""
    names = {"training-parallel-europarl-v7.tgz": "europarl_v7", "training-parallel-commoncrawl.tgz": "commoncrawl",
             "training-parallel-nc-v9.tgz": "news_commentary_v9"}
    out = []
    for filename, blob in archives.items():
        key = f"data.sources.{names[filename]}"
        out += [f"{key}.url={base_url}/{filename}", f"{key}.sha256={sha256(blob)}", f"{key}.size={len(blob)}"]
    return out


class LocalServer:
    """An HTTP server on 127.0.0.1 (a free port) in a thread, for the span of a `with` block."""

    def serve(self, handler) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FixtureServer(LocalServer):
    """Serves `files` (name -> bytes). Names in `cut_once` get half their bytes on the first request, then the
    connection closes. Every request is logged as (path, Range header or None)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.cut_once, self.requests = dict(files), set(), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                server.requests.append((name, self.headers.get("Range")))
                if name not in server.files:
                    self.send_error(404)
                    return
                body, start = server.files[name], 0
                ranged = self.headers.get("Range")
                if ranged:
                    start = int(ranged.split("=")[1].split("-")[0])
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                payload = body[start:]
                if name in server.cut_once:
                    server.cut_once.discard(name)
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(payload)

        self.serve(Handler)


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)
