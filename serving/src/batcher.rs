//! Dynamic batching, as Triton's dynamic batcher: requests queue, and the
//! oldest waits up to a maximum queue delay for others to join it in one
//! batch of at most the maximum batch size. Each model instance (Triton's
//! instance group) runs batches on a thread of its own, one at a time, its
//! lookups and layers on its share of the threads; an idle instance takes
//! the next batch. A request past its deadline, or whose client left, is
//! dropped before its batch runs; a full server sheds new requests. A
//! model that fails or panics on a batch of several requests runs each
//! alone, so only the request at fault fails. A new model (hot reload) is
//! swapped into each instance between its batches: a batch running
//! finishes on the old one.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::inputs::{Inputs, Samples};
use crate::metrics::{Failure, Metrics};
use crate::model::Scorer;
use crate::outputs::{check_columns, request_columns, Column};
use crate::ServeError;

/// How requests are batched and how many are held.
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// How long the oldest queued request waits for others to join its
    /// batch (Triton's `max_queue_delay_microseconds`; zero: it runs with
    /// those queued already).
    pub max_queue_delay: Duration,
    /// Requests the server holds at once (being read, queued or computed);
    /// one more is shed with a 503.
    pub max_queue_size: usize,
    /// A request's deadline when it gives none (Triton's
    /// `default_timeout_microseconds`; `None`: no deadline).
    pub default_timeout: Option<Duration>,
    /// Threads of the model's lookups and layers, shared out among its
    /// instances (`None`: every core).
    pub threads: Option<usize>,
}

impl Default for BatchOptions {
    /// 1 ms of queue delay, 1024 requests held, no deadline, every core.
    fn default() -> Self {
        Self {
            max_queue_delay: Duration::from_millis(1),
            max_queue_size: 1024,
            default_timeout: None,
            threads: None,
        }
    }
}

/// A request's outputs, and the model version that gave them.
#[derive(Debug)]
pub struct Scored {
    /// One column each of the model's outputs, in order.
    pub columns: Vec<Column>,
    /// The version of the model that scored them.
    pub version: u64,
}

/// A request waiting for its batch.
struct Job {
    samples: Samples,
    queued: Instant,
    deadline: Option<Instant>,
    reply: oneshot::Sender<Result<Scored, ServeError>>,
}

/// The queue and what the instances are told.
struct Queue {
    jobs: VecDeque<Job>,
    /// For each instance, a model to swap in before its next batch, and
    /// its version.
    next_models: Vec<Option<(Box<dyn Scorer>, u64)>>,
    /// Whether an instance is forming a batch (waiting out the queue
    /// delay): the others leave the queue to it meanwhile, so that
    /// requests join its batch rather than start small ones.
    forming: bool,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    held: AtomicUsize,
    /// Each instance's version.
    versions: Vec<AtomicU64>,
    metrics: Arc<Metrics>,
    options: BatchOptions,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn version(&self) -> u64 {
        let versions = self.versions.iter().map(|v| v.load(Ordering::Acquire));
        versions.min().unwrap_or(1)
    }
}

/// The instances' threads and their queue.
pub struct Batcher {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

/// A request held by the server; let go when dropped.
pub struct Permit(Arc<Shared>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.pending.dec();
    }
}

impl Batcher {
    /// Starts a thread for each of `instances` (version 1) reading
    /// `inputs`' requests.
    pub fn start(
        instances: Vec<Box<dyn Scorer>>,
        inputs: Arc<Inputs>,
        options: BatchOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self, ServeError> {
        if options.max_queue_size == 0 {
            return Err(ServeError::Config(
                "the queue must hold at least 1 request".into(),
            ));
        }
        if instances.is_empty() {
            return Err(ServeError::Config(
                "a model needs at least 1 instance".into(),
            ));
        }
        let threads = match options.threads {
            Some(0) => return Err(ServeError::Config("threads must be at least 1".into())),
            Some(n) => n,
            // rayon's default: every core, or RAYON_NUM_THREADS.
            None => rayon::current_num_threads(),
        };
        // Each instance its share of the threads (the first ones one more
        // when they do not divide evenly), at least one.
        let n = instances.len();
        let pools = (0..n)
            .map(|k| {
                let share = threads / n + usize::from(k < threads % n);
                rayon::ThreadPoolBuilder::new()
                    .thread_name(move |i| format!("ember-infer-{k}-{i}"))
                    .num_threads(share.max(1))
                    .build()
                    .map_err(|e| ServeError::Config(format!("the inference threads: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        metrics.version.set(1);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                next_models: instances.iter().map(|_| None).collect(),
                forming: false,
                stop: false,
            }),
            wake: Condvar::new(),
            held: AtomicUsize::new(0),
            versions: instances.iter().map(|_| AtomicU64::new(1)).collect(),
            metrics,
            options,
        });
        let mut workers = Vec::with_capacity(instances.len());
        for (instance, (scorer, pool)) in instances.into_iter().zip(pools).enumerate() {
            let (mine, inputs) = (Arc::clone(&shared), Arc::clone(&inputs));
            let worker = std::thread::Builder::new()
                .name(format!("ember-batcher-{instance}"))
                .spawn(move || run(&mine, instance, scorer, &inputs, &pool));
            match worker {
                Ok(worker) => workers.push(worker),
                Err(e) => {
                    // Those started stop with the batcher dropped here.
                    drop(Self { shared, workers });
                    return Err(e.into());
                }
            }
        }
        Ok(Self { shared, workers })
    }

    /// Holds one more request, or refuses it (503) when the server holds
    /// as many as it takes.
    pub fn admit(&self) -> Result<Permit, ServeError> {
        let s = &self.shared;
        let limit = s.options.max_queue_size;
        let held = s.held.fetch_add(1, Ordering::AcqRel);
        s.metrics.pending.inc();
        let permit = Permit(Arc::clone(s));
        if held >= limit {
            s.metrics.failed(Failure::Rejected);
            return Err(ServeError::Unavailable(format!(
                "the server holds {limit} requests, as many as it takes (--max-queue-size): try again"
            )));
        }
        Ok(permit)
    }

    /// Queues a request's samples; the answer comes on the receiver. A
    /// `timeout` (else the default one) from `arrived` is its deadline.
    pub fn submit(
        &self,
        samples: Samples,
        arrived: Instant,
        timeout: Option<Duration>,
    ) -> oneshot::Receiver<Result<Scored, ServeError>> {
        let (reply, answer) = oneshot::channel();
        let timeout = timeout.or(self.shared.options.default_timeout);
        let job = Job {
            samples,
            queued: Instant::now(),
            deadline: timeout.map(|t| arrived + t),
            reply,
        };
        let mut queue = self.shared.lock();
        if queue.stop {
            drop(queue);
            let _ = job.reply.send(Err(ServeError::Unavailable(
                "the server is stopping".into(),
            )));
        } else {
            queue.jobs.push_back(job);
            let forming = queue.forming;
            drop(queue);
            // The instance forming a batch must hear of it, whichever
            // thread a single notification would reach.
            match forming {
                true => self.shared.wake.notify_all(),
                false => self.shared.wake.notify_one(),
            }
        }
        answer
    }

    /// Serves `instances` (one for each instance serving) as `version`,
    /// each from its instance's next batch on; a batch running finishes on
    /// the model before.
    pub fn swap(&self, instances: Vec<Box<dyn Scorer>>, version: u64) -> Result<(), ServeError> {
        let mut queue = self.shared.lock();
        if instances.len() != queue.next_models.len() {
            return Err(ServeError::Config(format!(
                "{} instances to swap in for {} serving",
                instances.len(),
                queue.next_models.len()
            )));
        }
        for (next, scorer) in queue.next_models.iter_mut().zip(instances) {
            *next = Some((scorer, version));
        }
        drop(queue);
        self.shared.wake.notify_all();
        Ok(())
    }

    /// The version serving: the oldest any instance runs.
    pub fn version(&self) -> u64 {
        self.shared.version()
    }

    /// The metrics it keeps.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }
}

impl Drop for Batcher {
    /// Answers the requests queued, then stops the threads.
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// An instance's thread: forms batches and runs them until stopped.
fn run(
    shared: &Shared,
    instance: usize,
    mut scorer: Box<dyn Scorer>,
    inputs: &Inputs,
    pool: &rayon::ThreadPool,
) {
    let m = &shared.metrics;
    let mut version = 1;
    loop {
        let (jobs, swapped) = {
            let mut queue = shared.lock();
            let mut swapped = None;
            loop {
                if let Some(next) = queue.next_models[instance].take() {
                    // Under the lock: instances swapping at once report in turn.
                    shared.versions[instance].store(next.1, Ordering::Release);
                    m.version.set(shared.version() as i64);
                    swapped = Some(next);
                    break;
                }
                drop_stale(&mut queue.jobs, m);
                if (!queue.jobs.is_empty() && !queue.forming) || queue.stop {
                    break;
                }
                queue = shared.wake.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
            if swapped.is_some() {
                (Vec::new(), swapped)
            } else if queue.jobs.is_empty() {
                return; // stopping, nothing left
            } else {
                let max = inputs.limits().max_batch_size;
                (take_batch(shared, instance, queue, max), None)
            }
        };
        if let Some((next, next_version)) = swapped {
            // The old model drops here, after its last batch.
            scorer = next;
            version = next_version;
            continue;
        }
        if !jobs.is_empty() {
            pool.install(|| execute(shared, version, scorer.as_mut(), inputs, jobs));
            if let Some((lookups, misses)) = scorer.cache() {
                m.cache_lookups.set(lookups as i64);
                m.cache_misses.set(misses as i64);
            }
        }
    }
}

/// Answers and removes the queued requests past their deadline, and
/// removes those whose client left.
fn drop_stale(jobs: &mut VecDeque<Job>, m: &Metrics) {
    let now = Instant::now();
    let stale = |j: &Job| j.reply.is_closed() || j.deadline.is_some_and(|d| d <= now);
    if !jobs.iter().any(stale) {
        return;
    }
    for job in std::mem::take(jobs) {
        if job.reply.is_closed() {
            m.failed(Failure::Canceled);
        } else if let Some(deadline) = job.deadline.filter(|&d| d <= now) {
            m.failed(Failure::Timeout);
            let late = (now - deadline).as_micros();
            let _ = job.reply.send(Err(ServeError::Unavailable(format!(
                "request timeout expired: its deadline passed {late} us before its batch ran"
            ))));
        } else {
            jobs.push_back(job);
        }
    }
}

/// `instance`'s next batch: the oldest request and those that join it
/// within the queue delay, up to `max_samples`. Requests left queued wake
/// an idle instance.
fn take_batch(
    shared: &Shared,
    instance: usize,
    mut queue: MutexGuard<'_, Queue>,
    max_samples: usize,
) -> Vec<Job> {
    let close_at = queue.jobs[0].queued + shared.options.max_queue_delay;
    let mut jobs = Vec::new();
    let mut samples = 0;
    queue.forming = true;
    'forming: loop {
        drop_stale(&mut queue.jobs, &shared.metrics);
        while let Some(job) = queue.jobs.front() {
            if samples + job.samples.count() > max_samples && !jobs.is_empty() {
                break 'forming; // the next request does not fit: the batch is full
            }
            samples += job.samples.count();
            jobs.extend(queue.jobs.pop_front());
        }
        let now = Instant::now();
        let swapping = queue.next_models[instance].is_some();
        if samples >= max_samples || now >= close_at || queue.stop || swapping {
            break;
        }
        queue = (shared.wake.wait_timeout(queue, close_at - now))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    queue.forming = false;
    if !queue.jobs.is_empty() {
        shared.wake.notify_one();
    }
    jobs
}

/// Runs one batch on `version` of the model and answers its requests; a
/// failure or a panic on several requests runs each alone.
fn execute(
    shared: &Shared,
    version: u64,
    scorer: &mut dyn Scorer,
    inputs: &Inputs,
    jobs: Vec<Job>,
) {
    let m = &shared.metrics;
    let start = Instant::now();
    for job in &jobs {
        let waited = start - job.queued;
        m.queue_us.inc_by(waited.as_micros() as u64);
        m.queue_seconds.observe(waited.as_secs_f64());
    }
    let parts: Vec<&Samples> = jobs.iter().map(|j| &j.samples).collect();
    let scored = score(scorer, inputs, &parts, m);
    let outputs = inputs.outputs();
    match scored {
        Ok(columns) => {
            let split = Instant::now();
            let mut at = 0;
            for job in jobs {
                let n = job.samples.count();
                let mine = request_columns(&columns, outputs, (at, at + n));
                at += n;
                let _ = job
                    .reply
                    .send(mine.map(|columns| Scored { columns, version }));
            }
            m.output_us.inc_by(split.elapsed().as_micros() as u64);
        }
        Err(e) if jobs.len() == 1 => {
            let job = jobs.into_iter().next().expect("one job");
            let _ = job.reply.send(Err(e));
        }
        Err(_) => {
            for job in jobs {
                let n = job.samples.count();
                let alone = score(scorer, inputs, &[&job.samples], m)
                    .and_then(|columns| request_columns(&columns, outputs, (0, n)))
                    .map(|columns| Scored { columns, version });
                let _ = job.reply.send(alone);
            }
        }
    }
}

/// The model's outputs for `parts` joined, checked; a panic caught as an
/// error.
fn score(
    scorer: &mut dyn Scorer,
    inputs: &Inputs,
    parts: &[&Samples],
    m: &Metrics,
) -> Result<Vec<Column>, ServeError> {
    let start = Instant::now();
    let batch = inputs.batch(parts)?;
    let joined = Instant::now();
    let count = batch.labels.len();
    let result = catch_unwind(AssertUnwindSafe(|| scorer.score(&batch)));
    let done = Instant::now();
    m.executions.inc();
    m.batch_size.observe(count as f64);
    let requests = parts.len() as u64;
    m.input_us
        .inc_by((joined - start).as_micros() as u64 * requests);
    m.infer_us
        .inc_by((done - joined).as_micros() as u64 * requests);
    match result {
        Ok(Ok(columns)) => {
            check_columns(&columns, inputs.outputs(), count)?;
            m.inferences.inc_by(count as u64);
            Ok(columns)
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ServeError::Internal(
            "the model panicked on this request; the server goes on".into(),
        )),
    }
}
