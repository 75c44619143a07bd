"""A load generator for `-m serve` on Python's asyncio (standard library
only): the crowds and hostile clients of tests/test_serve_crowd.py, each a
function that returns what it saw, for the suite to judge.

- request(): one HTTP/1.1 request on a fresh connection (Connection:
  close), its status, headers, body and seconds; the body read by
  Content-Length or chunked transfer coding.
- crowd(): many requests sent at the same moment.
- slowloris(): connections that send a request header a byte at a time and
  never finish it; a connection the server closes is opened again.
- non_readers(): streamed completions whose clients never read (plain
  sockets with a small receive buffer and segment size, so that the
  kernel's buffers take little of the stream).
- server_usage(), server_cpu(): a process's resident memory, open
  descriptors and CPU time, from /proc.
"""
import asyncio
import json
import os
import random
import resource
import socket
import time

HOST = '127.0.0.1'


def raise_nofile(want=65536):
    """The soft limit on open descriptors raised toward the hard one; returns
    the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def request_bytes(method, path, body=None, close=True):
    data = json.dumps(body).encode() if body is not None else b''
    head = '%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n' % (method, path, len(data))
    if close:
        head += 'Connection: close\r\n'
    return head.encode() + b'\r\n' + data


async def read_response(reader):
    """(status, headers with lower-case names, body) of one answer."""
    line = await reader.readline()
    if not line:
        raise ConnectionError('closed without an answer')
    status = int(line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b'\r\n', b''):
            break
        name, value = line.decode('latin-1').split(':', 1)
        headers[name.strip().lower()] = value.strip()
    if 'content-length' in headers:
        body = await reader.readexactly(int(headers['content-length']))
    elif headers.get('transfer-encoding') == 'chunked':
        body = b''
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.read()
    return status, headers, body


async def request(port, method, path, body=None, timeout=120):
    """One request on a fresh connection: (status, headers, body, seconds);
    status is None and body the error's text when it failed."""
    t0 = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
        writer.write(request_bytes(method, path, body))
        await writer.drain()
        status, headers, data = await asyncio.wait_for(read_response(reader), timeout)
        return status, headers, data, time.monotonic() - t0
    except (OSError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        return None, {}, '%s: %s' % (type(e).__name__, e), time.monotonic() - t0
    finally:
        if writer:
            writer.close()


async def crowd(port, bodies, path='/v1/completions'):
    """Every body POSTed at once, each on its own connection: the results of
    request() in the same order."""
    return await asyncio.gather(*[request(port, 'POST', path, b) for b in bodies])


async def slowloris(port, n, interval, stop):
    """n connections that each send an endless header, one byte every
    `interval` seconds (starting at random moments within the first), until
    `stop` is set. Returns (connections opened, of them closed by the
    server)."""
    counts = {'opened': 0, 'closed': 0}
    header = b'GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ' + b'z' * 100000

    async def one():
        await asyncio.sleep(random.random() * interval)
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(HOST, port)
            except OSError:
                await asyncio.sleep(interval)
                continue
            counts['opened'] += 1
            try:
                for i in range(len(header)):
                    writer.write(header[i:i + 1])
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(4096), interval) == b'':
                            counts['closed'] += 1
                            break
                    except asyncio.TimeoutError:
                        pass
                    if stop.is_set():
                        break
            except (OSError, ConnectionError):
                counts['closed'] += 1
            finally:
                writer.close()
    await asyncio.gather(*[one() for _ in range(n)])
    return counts['opened'], counts['closed']


def non_readers(port, n, body, stream=True):
    """n completions, streamed unless told, on plain sockets that are never
    read (a 1 KB receive buffer, 536-byte segments): the sockets, for the
    caller to close."""
    socks = []
    data = request_bytes('POST', '/v1/completions', dict(body, stream=stream))
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.connect((HOST, port))
        s.sendall(data)
        socks.append(s)
    return socks


def open_idle(port, n):
    """n connections that send nothing."""
    return [socket.create_connection((HOST, port)) for _ in range(n)]


def server_usage(pid):
    """(resident memory in KiB, open descriptors) of process pid."""
    rss = 0
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            if line.startswith('VmRSS:'):
                rss = int(line.split()[1])
    return rss, len(os.listdir('/proc/%d/fd' % pid))


def server_cpu(pid):
    """The CPU seconds (user and system) process pid has used."""
    with open('/proc/%d/stat' % pid) as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def metrics(port):
    """/metrics as a dict of numbers."""
    status, _, data, _ = asyncio.run(request(port, 'GET', '/metrics'))
    assert status == 200, data
    out = {}
    for line in data.decode().splitlines():
        if line and not line.startswith('#'):
            name, value = line.split()
            out[name] = float(value)
    return out


def settle(port, timeout=20):
    """Waits until the server runs and queues nothing and holds only the
    connection that asks; returns its metrics then."""
    deadline = time.time() + timeout
    while True:
        m = metrics(port)
        quiet = m['run_running_requests'] == 0 and m['run_queue_length'] == 0 and m['run_connections_open'] <= 1
        if quiet or time.time() > deadline:
            return m
        time.sleep(0.1)
