"""One home for the names several processes must agree on: task queues, workflow ids,
search attributes, activity names, error types. Change one here and every worker, client
and test follows.

Values are a wire contract, not spelling. Activity names are recorded in workflow
histories: changing one breaks the replay of every running deployment (a rename is a new
constant behind ``workflow.patched``). Error types are matched by processes that may run
another version (a worker mid-upgrade), so they keep their values too."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from .domain.ids import DeploymentId, NodeId

#: Task queue polled by the control-plane worker (`modelkeeper worker`).
CONTROL_TASK_QUEUE = "modelkeeper-control"
#: ... and the queue of its room watches (watch_for_room), polled by a second worker in the
#: same process. A watch holds its activity slot for as long as its deployment cannot be
#: placed: on the control queue, 100 of them would take every slot (the SDK's default) and
#: no placement, release or store write could run.
ROOM_WATCH_TASK_QUEUE = "modelkeeper-room-watch"

#: Prefix of each node agent's own task queue; activities that touch a node's engines run there.
NODE_TASK_QUEUE_PREFIX = "node/"

#: Custom search attributes registered on the Temporal server (name -> type). A workflow
#: that upserts one the server lacks fails its workflow task until it is registered:
#: register a new one everywhere (`up`, docker-compose.temporal.yml) before a worker that
#: sets it rolls out.
SEARCH_ATTRIBUTES: dict[str, str] = {
    "ModelId": "Keyword",
    "DeploymentStatus": "Keyword",
    #: Ready replicas, and the replicas wanted, of a deployment.
    "ReadyReplicas": "Int",
    "DesiredReplicas": "Int",
    #: Every node holding a claim of the deployment.
    "NodeIds": "KeywordList",
}


#: The Temporal web UI's saved view of the deployments (docs/keeper.md, "The web UI's
#: list"): this query, with the search attributes above as its columns, in this order.
DEPLOYMENTS_VIEW_QUERY = "WorkflowType = 'DeploymentWorkflow' AND ExecutionStatus = 'Running'"
DEPLOYMENTS_VIEW_COLUMNS = ("ModelId", "DeploymentStatus", "ReadyReplicas", "DesiredReplicas",
                            "NodeIds")


def node_task_queue(node_id: NodeId) -> str:
    """The task queue a node's agent polls."""
    return f"{NODE_TASK_QUEUE_PREFIX}{node_id}"


def deployment_workflow_id(deployment_id: DeploymentId) -> str:
    """The workflow id of a deployment's keeper; one running workflow per deployment."""
    return f"deployment/{deployment_id}"

#: The database `up` creates inside its embedded PostgreSQL, and the superuser initdb
#: makes there. Every role logs in with a password (SCRAM), kept in a file of its own
#: under the data dir (local_database_passfile); see docs/security.md.
LOCAL_DATABASE_NAME = "modelkeeper"
LOCAL_DATABASE_USER = "postgres"
#: The role that owns `up`'s database and its schema: the API, the worker and the
#: `tokens` and `keys` commands connect as it (Compose's owner role has the same name).
LOCAL_DATABASE_OWNER = "modelkeeper"
#: The folder of the data dir that holds the password files of `up`'s database roles.
LOCAL_DATABASE_SECRETS_DIR = "secrets"


def local_database_passfile(data_dir: Path, role: str) -> Path:
    """The password file (libpq's pgpass format, mode 0600) of ``role`` on the embedded
    server of the `modelkeeper up` whose data dir is ``data_dir``."""
    return data_dir / LOCAL_DATABASE_SECRETS_DIR / f"{role}.pgpass"


def local_database_url(host: str, port: int, *, data_dir: Path,
                       role: str = LOCAL_DATABASE_OWNER,
                       database: str = LOCAL_DATABASE_NAME) -> str:
    """An asyncpg DSN for ``role`` on the embedded server of a local `modelkeeper up`.

    It names the role's password file, never the password: the DSN travels in children's
    environments and may be printed, the password stays in a file only its user reads."""
    passfile = quote(str(local_database_passfile(data_dir, role)))
    return f"postgresql://{role}@{host}:{port}/{database}?passfile={passfile}"


#: PostgreSQL NOTIFY channels (see migration 0002); payload is a deployment id.
REPLICAS_CHANNEL = "modelkeeper_replicas"
DEPLOYMENTS_CHANNEL = "modelkeeper_deployments"
#: NOTIFY channel for client API key changes (migration 0003); payload is a key prefix.
API_KEYS_CHANNEL = "modelkeeper_api_keys"
#: NOTIFY channel for demand (migration 0016): a gateway worker's waiting count for a
#: deployment rose from 0; payload is the deployment id. The usage watches listen.
DEMAND_CHANNEL = "modelkeeper_demand"

#: Signals, updates and queries of DeploymentWorkflow, by name, for senders that do not
#: import the workflow class (the API and the store activities).
SIGNAL_NODES_CHANGED = "nodes_changed"
SIGNAL_RETRY = "retry"
SIGNAL_DELETE = "delete"
#: The API tells a deployment that a node holding some of its replicas went silent (its
#: agent's liveness stream broke or stopped): those replicas are unreachable now.
SIGNAL_NODE_SILENT = "node_silent"
UPDATE_SCALE = "scale"
#: The change primitive the sagas use (modelkeeper.domain.moves): surge, replace, retire,
#: the long poll on a move's outcome, its compensation, and the generation to run.
UPDATE_MOVE = "move"
UPDATE_AWAIT_MOVE = "await_move"
UPDATE_CANCEL_MOVE = "cancel_move"
UPDATE_SET_GENERATION = "set_generation"
#: Following demand (modelkeeper.domain.demand): a new scaling policy, a schedule window
#: opening or closing, an operator's sleep or wake, and another deployment's eviction.
UPDATE_SET_POLICY = "set_policy"
#: A deployment's owner or capacity class changed (modelkeeper.domain.capacity).
UPDATE_SET_TENANCY = "set_tenancy"
UPDATE_SET_WINDOW = "set_window"
UPDATE_SLEEP = "sleep"
UPDATE_WAKE = "wake"
#: A signal, not an update: it comes from another deployment's workflow, which cannot
#: send updates; the keeper checks it (modelkeeper.domain.keeper.refuse_eviction).
SIGNAL_EVICT = "evict"
#: Stop one replica and hold its place back until room returns
#: (modelkeeper.domain.capacity.PreemptRequest): sent by a placement that outranks it and
#: by the API's memory watchdog (api/watchdog.py) on a critical node.
SIGNAL_PREEMPT = "preempt"
#: workflow.patched ids (docs/keeper.md, "The patch schedule"). 0.3: a deployment that
#: fits nowhere seeks room from lower classes (issue 22).
PATCH_PREEMPTION = "capacity-preemption"
#: 0.3: a multi-node replica's start fails at its first failed shard, and its status
#: names each shard that ended (issue 23; docs/engines.md).
PATCH_MULTI_NODE = "multi-node-shards"
#: 0.3: an engine that exits after ready is relaunched in place first
#: (modelkeeper.domain.relaunch).
PATCH_RELAUNCH = "relaunch-in-place"
#: 0.3: a drain judges what is left by the node, not by the replica ids it listed first: a
#: replica another saga replaced meanwhile has left the node (issue 24; workflows/drain.py).
PATCH_DRAIN_BY_NODE = "drain-judges-by-node"
#: 0.3: a saga whose failure was handled as designed (rolled back, nothing changed, or
#: compensated) completes with its record; only rollback_incomplete, an undo that failed,
#: and errors it did not expect fail the workflow (issue 24; workflows/saga.py).
PATCH_SAGA_OUTCOME = "saga-outcome-completes"
#: 0.3: the ModelId search attribute follows the model a deployment runs (its committed
#: generation's) after a switch, where it kept the model it was created for (issue 24).
PATCH_MODEL_ID_FOLLOWS_SWITCH = "model-id-follows-switch"
QUERY_STATUS = "status"
#: A deployment as a saga sees it (modelkeeper.domain.moves.DeploymentBrief).
QUERY_BRIEF = "brief"

#: Activities, by name, for the workflows that call them without importing their modules
#: (``activities.store`` holds the store, which workflows must not import). Control queue:
ACTIVITY_RECORD_EVENT = "record_event"
ACTIVITY_PLACE_REPLICA = "place_replica"
ACTIVITY_RECORD_REPLICA_STATE = "record_replica_state"
ACTIVITY_RELEASE_REPLICA = "release_replica"
ACTIVITY_RECORD_DEPLOYMENT_STATUS = "record_deployment_status"
ACTIVITY_DELETE_DEPLOYMENT = "delete_deployment"
#: A deployment that cannot be placed dry-runs placement on a backoff schedule and returns
#: once its replica would fit (long-running, heartbeating; claims nothing).
ACTIVITY_WATCH_FOR_ROOM = "watch_for_room"
#: Routing: mark a replica draining and wait (bounded) for its in-flight requests.
ACTIVITY_DRAIN_REPLICA = "drain_replica"
#: Following demand (control side): the usage watch (long-running, like the room watch;
#: returns when a scaling step is due), a sleeping replica's claims shrunk to what it
#: keeps and grown back before a wake, and the choice of a replica to evict for room.
ACTIVITY_WATCH_DEMAND = "watch_demand"
ACTIVITY_SHRINK_CLAIMS = "shrink_claims"
ACTIVITY_REGROW_CLAIMS = "regrow_claims"
ACTIVITY_FIND_EVICTION = "find_eviction"
#: Scaling by the clock (WindowWorkflow, workflows/window.py): ask a deployment to open or
#: close a schedule window, and remove the schedules of a window whose deployment is gone.
ACTIVITY_APPLY_WINDOW = "apply_window"
ACTIVITY_DROP_WINDOW = "drop_window"
#: The sagas' activities (control queue), as their stubs (activities.saga_stubs) and the
#: classes that run them register them: ask a deployment workflow (activities.moves) ...
ACTIVITY_REQUEST_MOVE = "request_move"
ACTIVITY_AWAIT_MOVE = "await_move"
ACTIVITY_CANCEL_MOVE = "cancel_move"
ACTIVITY_SET_GENERATION = "set_generation"
ACTIVITY_DESCRIBE_DEPLOYMENT = "describe_deployment"
#: ... and keep their record and the cordon in the store (activities.operations).
ACTIVITY_BEGIN_OPERATION = "begin_operation"
ACTIVITY_RECORD_OPERATION = "record_operation"
ACTIVITY_SET_CORDON = "set_cordon"
ACTIVITY_NODE_DEPLOYMENTS = "node_deployments"
#: ... and each node's own queue (:func:`node_task_queue`):
ACTIVITY_START_SHARD = "start_shard"
ACTIVITY_WATCH_SHARD = "watch_shard"
ACTIVITY_STOP_SHARD = "stop_shard"
ACTIVITY_LIST_SHARDS = "list_shards"
#: ... sleep (free the KV cache, keep the weights) and wake an engine that can.
ACTIVITY_SLEEP_SHARD = "sleep_shard"
ACTIVITY_WAKE_SHARD = "wake_shard"

#: ApplicationError types: activities raise them, workflows match on them (retry policies'
#: ``non_retryable_error_types``), clients read them. Store activities:
ERROR_UNKNOWN_MODEL = "UnknownModel"
ERROR_SETTLING = "Settling"
#: ... node activities:
ERROR_SHARD_START_FAILED = "ShardStartFailed"
ERROR_ENGINE_CONFIG = "EngineConfigError"
ERROR_NO_FREE_PORT = "NoFreePort"
#: ... sleep_shard and wake_shard: the node runs no such shard; the engine refused (or did
#: not answer) a sleep or a wake.
ERROR_SHARD_NOT_HERE = "ShardNotHere"
ERROR_SLEEP_WAKE_FAILED = "SleepWakeFailed"
#: ... and DeploymentWorkflow's scale validator, refusing an update while it deletes.
ERROR_DELETING = "Deleting"
#: ... refusing a move (unknown replica, leased to another move, surge limit), and
#: begin_operation refusing a second saga on one deployment or node.
ERROR_MOVE_REFUSED = "MoveRefused"
ERROR_OPERATION_CONFLICT = "OperationConflict"
#: ... a deployment workflow a saga asks that is not running (deleted, never started).
ERROR_NO_DEPLOYMENT = "NoDeployment"


#: Saga workflow types (workflows/restart.py, drain.py, switch.py); reconfigure is a
#: switch with the same model and other engine arguments.
WORKFLOW_RESTART = "RestartSaga"
WORKFLOW_DRAIN = "DrainSaga"
WORKFLOW_SWITCH = "SwitchSaga"
#: The query every saga answers with its OperationRecord.
QUERY_OPERATION = "operation"
#: A saga that ends rollback_incomplete, with a failed undo or on an error it did not expect
#: fails its workflow with this error type, the record's error as its message and the
#: record as its detail (one that failed or rolled back as designed completes:
#: PATCH_SAGA_OUTCOME).
ERROR_OPERATION_FAILED = "OperationFailed"


def operation_workflow_id(kind: str, subject: str, n: int) -> str:
    """A saga's workflow id, readable: ``restart/<deployment>/<n>``, ``drain/<node>/<n>``."""
    return f"{kind}/{subject}/{n}"


#: The workflow type a schedule window's schedules start (workflows/window.py): by name,
#: since the schedules are made below the workflows (modelkeeper.infra.schedules).
WORKFLOW_WINDOW = "ScheduleWindow"
#: Every schedule of a deployment's windows has an id under this prefix.
WINDOW_SCHEDULE_PREFIX = "window/"


def window_schedules_prefix(deployment_id: DeploymentId) -> str:
    """The prefix of the ids of every schedule of ``deployment_id``'s windows."""
    return f"{WINDOW_SCHEDULE_PREFIX}{deployment_id}/"


def window_schedule_id(deployment_id: DeploymentId, name: str, edge: str) -> str:
    """The id of the schedule that opens (``edge`` "open") or closes a window, and of the
    workflows it starts (Temporal adds each run's time): ``window/<deployment>/<name>/open``."""
    return f"{window_schedules_prefix(deployment_id)}{name}/{edge}"


#: The notification workflows (workflows/notify.py), started by name from below the
#: workflows (modelkeeper.infra.notify): one delivers a notice to every target; one waits
#: out a deployment's unplaceable stretch before it sends one.
WORKFLOW_NOTIFY = "Notify"
WORKFLOW_CANT_PLACE_WATCH = "CantPlaceWatch"
#: Their activities (activities/notify.py). Recorded in their histories: keep the names.
ACTIVITY_NOTIFY_TARGETS = "notify_targets"
ACTIVITY_DELIVER_NOTICE = "deliver_notice"
ACTIVITY_CANT_PLACE_SINCE = "cant_place_since"
ACTIVITY_SEND_NOTICE = "send_notice"
#: A delivery the receiver refused for good (a 4xx other than 408, 425 and 429).
ERROR_NOTICE_REFUSED = "NoticeRefused"


def cant_place_watch_id(deployment_id: str) -> str:
    """The one watch of a deployment's unplaceable stretch; a second start joins it."""
    return f"notify-watch/deployment.cant_place/{deployment_id}"
