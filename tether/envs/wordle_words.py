"""The `wordle` environment's answer words: common 5-letter English words, lower case, one list
written for tether (not taken from any game's list). Guesses are not limited to this list."""

WORDS: tuple[str, ...] = tuple("""
about above abuse actor acute admit adopt adult after again agent agree ahead alarm album alert
alike alive allow alone along alter amber among angel anger angle angry apart apple apply arena
argue arise armor array arrow aside asset audio audit avoid award aware awful bacon badge badly
baker basic basin batch beach beard beast begin being belly below bench berry birth black blade
blame bland blank blast blaze bleak blend bless blind block blood bloom blown board boast bonus
boost booth bound brain brand brass brave bread break breed brick bride brief bring brink broad
broke brown brush buddy build built bunch burst buyer cabin cable camel canal candy cargo carry
catch cause cedar chain chair chalk charm chart chase cheap check cheek cheer chess chest chief
child chill choir chord chose civic civil claim clash class clean clear clerk click cliff climb
clock close cloth cloud coach coast comet coral couch could count court cover crack craft crane
crash crawl crazy cream creek crest crime crisp cross crowd crown crude crumb crush curve cycle
daily dairy dance dealt death debut decay delay delta dense depth diary dirty ditch dodge donor
doubt dough draft drain drama drank drawn dream dress dried drift drill drink drive drove dwarf
eager eagle early earth easel eaten eight elbow elder elect elite empty enemy enjoy enter entry
equal error essay event every exact exist extra fable faith false fancy feast fence ferry fever
fiber field fifth fifty fight final flame flash fleet flesh float flock flood floor flour fluid
flute focus foggy force forge forth forty forum found frame fresh front frost fruit fudge fully
funny gauge ghost giant given glass gleam globe glove goose grace grade grain grand grant grape
graph grasp grass grave gravy great greed green greet grief grill grind groan group grove growl
grown guard guess guest guide guilt habit happy harsh haste hatch haven heart heavy hedge hello
hinge hobby honey honor horse hotel house hover human humid humor hurry ideal image imply index
inner input irony issue ivory jelly jewel joint judge juice jumbo karma kayak knife knock known
label labor large laser later laugh layer learn lease least leave ledge legal lemon level lever
light limit linen liver lobby local lodge logic loose lover lower loyal lucky lunar lunch lyric
magic major maker mango manor maple march marsh match mayor medal media melon mercy merge merit
metal meter midst might minor mixed model moist money month moral motor mound mount mouse mouth
movie muddy music naive nerve never night noble noise north novel nurse nylon oasis ocean offer
often olive onion opera orbit order organ other otter ought ounce outer owner oxide paint panel
panic paper party pasta patch pause peace peach pearl pedal penny perch phase phone photo piano
piece pilot pinch pitch pixel pizza place plain plane plant plate plaza plead pluck plumb point
polar porch pound power press price pride prime print prior prize probe proof proud prove pulse
punch pupil purse quake queen query quest quick quiet quilt quite quota quote radar radio raise
rally ranch range rapid ratio reach react ready realm rebel refer reign relax relay renew reply
rider ridge rifle right rigid rinse risky rival river roast robin robot rocky rough round route
royal rugby ruler rural salad salon sauce scale scarf scene scent scope score scout scrap sense
serve setup seven shade shake shall shape share shark sharp sheep sheet shelf shell shift shine
shirt shock shore short shout shown siege sight silly since sixth sixty skill skirt skull slate
sleep slice slide slope small smart smell smile smoke snack snake solar solid solve sorry sound
south space spare spark speak speed spell spend spent spice spine spoke spoon sport spray squad
stack staff stage stain stair stake stale stamp stand stare start state steam steel steep steer
stern stick still stock stone stood stool storm story stove strap straw strip stuck study stuff
style sugar suite sunny super surge swamp swear sweat sweep sweet swift swing sword table taken
taste teach teeth tempo thank theme there thick thief thing think third thorn those three threw
throw thumb tiger tight timer title toast today token topic torch total touch tough tower toxic
trace track trade trail train trait treat trend trial tribe trick tried troop truck truly trunk
trust truth tulip tumor twice twist ultra uncle under union unity until upper upset urban usage
usual valid value valve vapor vault verse video vigor viral virus visit vital vivid vocal voice
voter wagon waste watch water weary weave wedge weigh weird whale wheat wheel where which while
whirl white whole whose widow width windy witch woman world worry worse worst worth would wound
woven wrist write wrong wrote yacht yearn yield young youth zebra
""".split())
