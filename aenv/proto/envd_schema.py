"""The envd wire schema: process.proto and filesystem.proto as pb tables.

Field numbers, enum values and oneofs match the messages the `e2b` SDKs are
generated from (`packages/envd/spec/*.proto` in e2b-dev/infra). `SERVICES`
lists every RPC with its request/response types and streaming shape, which is
all the Connect layer needs to route a call. `ENVD_VERSION` is the version
aenv's envd reports; the SDKs gate features on it (stdin control 0.3.0,
default user 0.4.0, CloseStdin 0.5.2, octet-stream uploads 0.5.7, file
metadata 0.6.2, entries in watch events 0.6.3, watching network mounts 0.6.4).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aenv.proto.pb import TIMESTAMP, EnumType, Field, Kind, MessageType

ENVD_VERSION = "0.6.4"

S, B, BOOL, U32, I64 = Kind.STRING, Kind.BYTES, Kind.BOOL, Kind.UINT32, Kind.INT64


def _msg(name: str, *fields: Field) -> MessageType:
    return MessageType(name, fields)


def _sub(number: int, name: str, mtype: MessageType, **kw: object) -> Field:
    return Field(number, name, Kind.MESSAGE, message=mtype, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ process

SIGNAL = EnumType(
    "process.Signal",
    {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9},
)


class Signal(enum.IntEnum):
    UNSPECIFIED = 0
    SIGTERM = 15
    SIGKILL = 9


PTY_SIZE = _msg("process.PTY.Size", Field(1, "cols", U32), Field(2, "rows", U32))
PTY = _msg("process.PTY", _sub(1, "size", PTY_SIZE))
PROCESS_CONFIG = _msg(
    "process.ProcessConfig",
    Field(1, "cmd", S),
    Field(2, "args", S, repeated=True),
    Field(3, "envs", Kind.MAP),
    Field(4, "cwd", S, optional=True),
)
LIST_REQUEST = _msg("process.ListRequest")
PROCESS_INFO = _msg(
    "process.ProcessInfo",
    _sub(1, "config", PROCESS_CONFIG),
    Field(2, "pid", U32),
    Field(3, "tag", S, optional=True),
)
LIST_RESPONSE = _msg("process.ListResponse", _sub(1, "processes", PROCESS_INFO, repeated=True))
START_REQUEST = _msg(
    "process.StartRequest",
    _sub(1, "process", PROCESS_CONFIG),
    _sub(2, "pty", PTY, optional=True),
    Field(3, "tag", S, optional=True),
    Field(4, "stdin", BOOL, optional=True),
)
PROCESS_SELECTOR = _msg(
    "process.ProcessSelector",
    Field(1, "pid", U32, oneof="selector"),
    Field(2, "tag", S, oneof="selector"),
)
UPDATE_REQUEST = _msg(
    "process.UpdateRequest",
    _sub(1, "process", PROCESS_SELECTOR),
    _sub(2, "pty", PTY, optional=True),
)
UPDATE_RESPONSE = _msg("process.UpdateResponse")
START_EVENT = _msg("process.ProcessEvent.StartEvent", Field(1, "pid", U32))
DATA_EVENT = _msg(
    "process.ProcessEvent.DataEvent",
    Field(1, "stdout", B, oneof="output"),
    Field(2, "stderr", B, oneof="output"),
    Field(3, "pty", B, oneof="output"),
)
END_EVENT = _msg(
    "process.ProcessEvent.EndEvent",
    Field(1, "exit_code", Kind.SINT32),
    Field(2, "exited", BOOL),
    Field(3, "status", S),
    Field(4, "error", S, optional=True),
)
KEEPALIVE = _msg("process.ProcessEvent.KeepAlive")
PROCESS_EVENT = _msg(
    "process.ProcessEvent",
    _sub(1, "start", START_EVENT, oneof="event"),
    _sub(2, "data", DATA_EVENT, oneof="event"),
    _sub(3, "end", END_EVENT, oneof="event"),
    _sub(4, "keepalive", KEEPALIVE, oneof="event"),
)
START_RESPONSE = _msg("process.StartResponse", _sub(1, "event", PROCESS_EVENT))
CONNECT_RESPONSE = _msg("process.ConnectResponse", _sub(1, "event", PROCESS_EVENT))
PROCESS_INPUT = _msg(
    "process.ProcessInput",
    Field(1, "stdin", B, oneof="input"),
    Field(2, "pty", B, oneof="input"),
)
SEND_INPUT_REQUEST = _msg(
    "process.SendInputRequest",
    _sub(1, "process", PROCESS_SELECTOR),
    _sub(2, "input", PROCESS_INPUT),
)
SEND_INPUT_RESPONSE = _msg("process.SendInputResponse")
STREAM_INPUT_START = _msg(
    "process.StreamInputRequest.StartEvent", _sub(1, "process", PROCESS_SELECTOR)
)
STREAM_INPUT_DATA = _msg("process.StreamInputRequest.DataEvent", _sub(2, "input", PROCESS_INPUT))
STREAM_INPUT_KEEPALIVE = _msg("process.StreamInputRequest.KeepAlive")
STREAM_INPUT_REQUEST = _msg(
    "process.StreamInputRequest",
    _sub(1, "start", STREAM_INPUT_START, oneof="event"),
    _sub(2, "data", STREAM_INPUT_DATA, oneof="event"),
    _sub(3, "keepalive", STREAM_INPUT_KEEPALIVE, oneof="event"),
)
STREAM_INPUT_RESPONSE = _msg("process.StreamInputResponse")
SEND_SIGNAL_REQUEST = _msg(
    "process.SendSignalRequest",
    _sub(1, "process", PROCESS_SELECTOR),
    Field(2, "signal", Kind.ENUM, enum=SIGNAL),
)
SEND_SIGNAL_RESPONSE = _msg("process.SendSignalResponse")
CLOSE_STDIN_REQUEST = _msg("process.CloseStdinRequest", _sub(1, "process", PROCESS_SELECTOR))
CLOSE_STDIN_RESPONSE = _msg("process.CloseStdinResponse")
CONNECT_REQUEST = _msg("process.ConnectRequest", _sub(1, "process", PROCESS_SELECTOR))

# --------------------------------------------------------------- filesystem

FILE_TYPE = EnumType(
    "filesystem.FileType",
    {
        "FILE_TYPE_UNSPECIFIED": 0,
        "FILE_TYPE_FILE": 1,
        "FILE_TYPE_DIRECTORY": 2,
        "FILE_TYPE_SYMLINK": 3,
    },
)
EVENT_TYPE = EnumType(
    "filesystem.EventType",
    {
        "EVENT_TYPE_UNSPECIFIED": 0,
        "EVENT_TYPE_CREATE": 1,
        "EVENT_TYPE_WRITE": 2,
        "EVENT_TYPE_REMOVE": 3,
        "EVENT_TYPE_RENAME": 4,
        "EVENT_TYPE_CHMOD": 5,
    },
)


class FileType(enum.IntEnum):
    UNSPECIFIED = 0
    FILE = 1
    DIRECTORY = 2
    SYMLINK = 3


class EventType(enum.IntEnum):
    UNSPECIFIED = 0
    CREATE = 1
    WRITE = 2
    REMOVE = 3
    RENAME = 4
    CHMOD = 5


ENTRY_INFO = _msg(
    "filesystem.EntryInfo",
    Field(1, "name", S),
    Field(2, "type", Kind.ENUM, enum=FILE_TYPE),
    Field(3, "path", S),
    Field(4, "size", I64),
    Field(5, "mode", U32),
    Field(6, "permissions", S),
    Field(7, "owner", S),
    Field(8, "group", S),
    _sub(9, "modified_time", TIMESTAMP),
    Field(10, "symlink_target", S, optional=True),
    Field(11, "metadata", Kind.MAP),
    Field(12, "is_symlink", BOOL),
)
MOVE_REQUEST = _msg("filesystem.MoveRequest", Field(1, "source", S), Field(2, "destination", S))
MOVE_RESPONSE = _msg("filesystem.MoveResponse", _sub(1, "entry", ENTRY_INFO))
MAKE_DIR_REQUEST = _msg("filesystem.MakeDirRequest", Field(1, "path", S))
MAKE_DIR_RESPONSE = _msg("filesystem.MakeDirResponse", _sub(1, "entry", ENTRY_INFO))
REMOVE_REQUEST = _msg("filesystem.RemoveRequest", Field(1, "path", S))
REMOVE_RESPONSE = _msg("filesystem.RemoveResponse")
STAT_REQUEST = _msg("filesystem.StatRequest", Field(1, "path", S))
STAT_RESPONSE = _msg("filesystem.StatResponse", _sub(1, "entry", ENTRY_INFO))
LIST_DIR_REQUEST = _msg("filesystem.ListDirRequest", Field(1, "path", S), Field(2, "depth", U32))
LIST_DIR_RESPONSE = _msg(
    "filesystem.ListDirResponse", _sub(1, "entries", ENTRY_INFO, repeated=True)
)
WATCH_DIR_REQUEST = _msg(
    "filesystem.WatchDirRequest",
    Field(1, "path", S),
    Field(2, "recursive", BOOL),
    Field(3, "include_entry", BOOL),
    Field(4, "allow_network_mounts", BOOL),
)
FILESYSTEM_EVENT = _msg(
    "filesystem.FilesystemEvent",
    Field(1, "name", S),
    Field(2, "type", Kind.ENUM, enum=EVENT_TYPE),
    _sub(3, "entry", ENTRY_INFO, optional=True),
)
WATCH_START = _msg("filesystem.WatchDirResponse.StartEvent")
WATCH_KEEPALIVE = _msg("filesystem.WatchDirResponse.KeepAlive")
WATCH_DIR_RESPONSE = _msg(
    "filesystem.WatchDirResponse",
    _sub(1, "start", WATCH_START, oneof="event"),
    _sub(2, "filesystem", FILESYSTEM_EVENT, oneof="event"),
    _sub(3, "keepalive", WATCH_KEEPALIVE, oneof="event"),
)
CREATE_WATCHER_REQUEST = _msg(
    "filesystem.CreateWatcherRequest",
    Field(1, "path", S),
    Field(2, "recursive", BOOL),
    Field(3, "include_entry", BOOL),
    Field(4, "allow_network_mounts", BOOL),
)
CREATE_WATCHER_RESPONSE = _msg("filesystem.CreateWatcherResponse", Field(1, "watcher_id", S))
GET_WATCHER_EVENTS_REQUEST = _msg("filesystem.GetWatcherEventsRequest", Field(1, "watcher_id", S))
GET_WATCHER_EVENTS_RESPONSE = _msg(
    "filesystem.GetWatcherEventsResponse",
    _sub(1, "events", FILESYSTEM_EVENT, repeated=True),
)
REMOVE_WATCHER_REQUEST = _msg("filesystem.RemoveWatcherRequest", Field(1, "watcher_id", S))
REMOVE_WATCHER_RESPONSE = _msg("filesystem.RemoveWatcherResponse")

# ----------------------------------------------------------------- services


class StreamKind(enum.Enum):
    UNARY = "unary"
    SERVER_STREAM = "server_stream"
    CLIENT_STREAM = "client_stream"


@dataclass(frozen=True)
class Method:
    service: str
    name: str
    request: MessageType
    response: MessageType
    kind: StreamKind

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


_U, _SS, _CS = StreamKind.UNARY, StreamKind.SERVER_STREAM, StreamKind.CLIENT_STREAM

METHODS: tuple[Method, ...] = (
    Method("process.Process", "List", LIST_REQUEST, LIST_RESPONSE, _U),
    Method("process.Process", "Connect", CONNECT_REQUEST, CONNECT_RESPONSE, _SS),
    Method("process.Process", "Start", START_REQUEST, START_RESPONSE, _SS),
    Method("process.Process", "Update", UPDATE_REQUEST, UPDATE_RESPONSE, _U),
    Method("process.Process", "StreamInput", STREAM_INPUT_REQUEST, STREAM_INPUT_RESPONSE, _CS),
    Method("process.Process", "SendInput", SEND_INPUT_REQUEST, SEND_INPUT_RESPONSE, _U),
    Method("process.Process", "SendSignal", SEND_SIGNAL_REQUEST, SEND_SIGNAL_RESPONSE, _U),
    Method("process.Process", "CloseStdin", CLOSE_STDIN_REQUEST, CLOSE_STDIN_RESPONSE, _U),
    Method("filesystem.Filesystem", "Stat", STAT_REQUEST, STAT_RESPONSE, _U),
    Method("filesystem.Filesystem", "MakeDir", MAKE_DIR_REQUEST, MAKE_DIR_RESPONSE, _U),
    Method("filesystem.Filesystem", "Move", MOVE_REQUEST, MOVE_RESPONSE, _U),
    Method("filesystem.Filesystem", "ListDir", LIST_DIR_REQUEST, LIST_DIR_RESPONSE, _U),
    Method("filesystem.Filesystem", "Remove", REMOVE_REQUEST, REMOVE_RESPONSE, _U),
    Method("filesystem.Filesystem", "WatchDir", WATCH_DIR_REQUEST, WATCH_DIR_RESPONSE, _SS),
    Method(
        "filesystem.Filesystem",
        "CreateWatcher",
        CREATE_WATCHER_REQUEST,
        CREATE_WATCHER_RESPONSE,
        _U,
    ),
    Method(
        "filesystem.Filesystem",
        "GetWatcherEvents",
        GET_WATCHER_EVENTS_REQUEST,
        GET_WATCHER_EVENTS_RESPONSE,
        _U,
    ),
    Method(
        "filesystem.Filesystem",
        "RemoveWatcher",
        REMOVE_WATCHER_REQUEST,
        REMOVE_WATCHER_RESPONSE,
        _U,
    ),
)

METHODS_BY_PATH: dict[str, Method] = {m.path: m for m in METHODS}

ALL_MESSAGES: tuple[MessageType, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, MessageType)
)
