"""A scripted stand-in for /v1/audio/speech on 127.0.0.1 (stdlib only, runnable as a script).

A script maps a request's `input` to {"status": int, "chunks": [[delay_s, n_bytes], ...], "abort": bool}: after each
delay (from the previous chunk, or from the request) the server sends n_bytes of PCM as one HTTP chunk; `abort`
closes the connection instead of ending the body. Unscripted inputs stream forced_frames (default 8) frames of
4096 bytes, 4 frames per chunk, 10 ms apart. GET /health answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json

FRAME_BYTES = 2048 * 2


def default_script(body: dict) -> dict:
    frames = body.get("forced_frames") or 8
    return {"status": 200, "chunks": [[0.01, FRAME_BYTES * min(4, frames - i)] for i in range(0, frames, 4)]}


async def _respond(writer: asyncio.StreamWriter, status: int, ctype: str, payload: bytes) -> None:
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    await writer.drain()


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, scripts: dict) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path = lines[0].split(" ")[:2]
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = json.loads(await reader.readexactly(int(headers.get("content-length", 0))) or b"{}")
            if method == "GET" and path == "/health":
                await _respond(writer, 200, "application/json", b'{"status":"ok"}')
                continue
            script = scripts.get(body.get("input")) or default_script(body)
            if script["status"] != 200:
                err = {"error": {"message": "scripted", "type": "X", "param": None, "code": script["status"]}}
                await _respond(writer, script["status"], "application/json", json.dumps(err).encode())
                continue
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            for delay, n in script["chunks"]:
                await asyncio.sleep(delay)
                writer.write(f"{n:x}\r\n".encode() + b"\x01" * n + b"\r\n")
                await writer.drain()
            if script.get("abort"):
                break
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def start(scripts: dict, port: int = 0) -> asyncio.Server:
    """Start serving on 127.0.0.1:port (0 = any free port) in the running loop."""
    return await asyncio.start_server(lambda r, w: handle(r, w, scripts), "127.0.0.1", port)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--script", help="JSON file: input text -> script")
    args = ap.parse_args()
    scripts = json.load(open(args.script)) if args.script else {}

    async def serve():
        server = await start(scripts, args.port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
